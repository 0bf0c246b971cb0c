"""r3: MoE inference with Rollout Routing Replay (the routes of every token, per MoE layer).

LLM / SamplingParams: vLLM-like offline generation (text or token-id prompts, LLM.chat,
LLM.get_tokenizer). Tokenizer: a Hugging Face tokenizer.json with its chat template. AsyncLLM: vLLM's AsyncLLM shape for RL
frameworks (concurrent streamed requests, abort, pause, weight sync). Errors raise r3.Error
(a ValueError).
"""
from ._r3 import CompletionOutput, Error, LLM, RequestOutput, SamplingParams, Tokenizer
from .async_llm import AsyncLLM

__all__ = ["AsyncLLM", "CompletionOutput", "Error", "LLM", "RequestOutput", "SamplingParams", "Tokenizer"]

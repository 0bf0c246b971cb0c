# r3.AsyncLLM driven as verl drives vLLM's AsyncLLM: concurrent streamed requests with ids, an
# abort, pause / continue, prefix-cache reset, weights pushed from tensors with a version label.
import asyncio
import os

import numpy as np
import pytest

import r3
from helpers import prompt, read_safetensors

ENGINE = dict(num_kv_blocks=128, threads=1, max_num_batched_tokens=64, max_num_seqs=8)


async def collect(engine, p, sp, rid):
    outs = []
    async for out in engine.generate({"prompt_token_ids": p}, sp, request_id=rid):
        outs.append(out)
    return outs


def test_async_llm_like_verl(make_model):
    m0, m1 = make_model("olmoe"), make_model("olmoe", seed=1)
    sync0 = r3.LLM(model=m0, enable_return_routed_experts=True, **ENGINE)
    sync1 = r3.LLM(model=m1, enable_return_routed_experts=True, **ENGINE)
    sp = r3.SamplingParams(max_tokens=12, temperature=1.0, seed=3, ignore_eos=True)
    prompts = [prompt(10 + 5 * i, i) for i in range(5)]

    async def main():
        engine = r3.AsyncLLM(m0, enable_return_routed_experts=True, **ENGINE)
        long_sp = r3.SamplingParams(max_tokens=2000, temperature=1.0, seed=1, ignore_eos=True)
        victim = asyncio.ensure_future(collect(engine, prompt(8, 9), long_sp, "victim"))
        runs = await asyncio.gather(*[collect(engine, p, sp, f"req-{i}") for i, p in enumerate(prompts)])
        assert await engine.abort("victim") == 1
        cut = await victim
        assert cut[-1].finished and cut[-1].outputs[0].finish_reason == "abort"
        assert len(cut[-1].outputs[0].token_ids) < 2000
        for i, outs in enumerate(runs):
            final = outs[-1]
            assert final.finished and final.request_id == f"req-{i}"
            # Cumulative outputs: each one extends the one before.
            for a, b in zip(outs, outs[1:]):
                assert b.outputs[0].token_ids[:len(a.outputs[0].token_ids)] == a.outputs[0].token_ids
            want = sync0.generate([{"prompt_token_ids": prompts[i]}], sp)[0].outputs[0]
            assert final.outputs[0].token_ids == want.token_ids and final.outputs[0].logprobs == want.logprobs
            assert np.array_equal(final.outputs[0].routed_experts, want.routed_experts)

        # Weight sync, verl style: pause, push the new weights in two buckets, reset, continue.
        await engine.pause_generation("abort")
        tensors = read_safetensors(os.path.join(m1, "model.safetensors"))
        names = sorted(tensors)
        await engine.update_weights_from_tensors({k: tensors[k] for k in names[::2]}, finished=False)
        assert await engine.get_weight_version() == "0"
        await engine.update_weights_from_tensors({k: tensors[k] for k in names[1::2]}, weight_version="step-1")
        assert await engine.reset_prefix_cache()
        await engine.continue_generation()
        assert await engine.get_weight_version() == "step-1"
        after = await collect(engine, prompts[0], sp, "after")
        want = sync1.generate([{"prompt_token_ids": prompts[0]}], sp)[0].outputs[0]
        assert after[-1].outputs[0].token_ids == want.token_ids
        assert after[-1].outputs[0].weight_versions == [1] * len(want.token_ids)

        # sleep / wake_up, then a refit from disk with a label.
        await engine.sleep(1)
        await engine.wake_up(None)
        await engine.update_weights(m0, weight_version="back")
        again = await collect(engine, prompts[1], sp, "again")
        want0 = sync0.generate([{"prompt_token_ids": prompts[1]}], sp)[0].outputs[0]
        assert again[-1].outputs[0].token_ids == want0.token_ids
        assert await engine.get_weight_version() == "back"
        with pytest.raises(r3.Error, match="already in flight"):
            gen1 = collect(engine, prompt(8, 1), long_sp, "dup")
            gen2 = collect(engine, prompt(8, 2), long_sp, "dup")
            await asyncio.gather(gen1, gen2)
        await engine.abort("dup")
        engine.shutdown()

    asyncio.run(main())


def test_async_llm_cancel_aborts_and_n_is_refused(make_model):
    m0 = make_model("olmoe")

    async def main():
        engine = r3.AsyncLLM(m0, **ENGINE)
        long_sp = r3.SamplingParams(max_tokens=2000, temperature=1.0, seed=1, ignore_eos=True)
        task = asyncio.ensure_future(collect(engine, prompt(8, 3), long_sp, "cancel-me"))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # The id is free again: the cancelled request was aborted, not left running.
        short = r3.SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
        outs = await collect(engine, prompt(8, 3), short, "cancel-me")
        assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 3
        with pytest.raises(r3.Error, match="n = 1"):
            await collect(engine, prompt(4, 1), r3.SamplingParams(n=2), "many")
        engine.shutdown()

    asyncio.run(main())


def test_bad_seeds_and_a_shut_down_async_llm_are_r3_errors(make_model):
    for seed in (-1, 2**64, 1.5, "7", True):
        with pytest.raises(r3.Error, match="seed"):
            r3.SamplingParams(seed=seed)
    assert r3.SamplingParams(seed=2**64 - 1) is not None
    llm = r3.AsyncLLM(make_model("olmoe"))
    llm.shutdown()
    with pytest.raises(r3.Error, match="shut down"):
        asyncio.run(llm.abort("x"))


def test_an_aborted_request_resumes_exactly_as_the_uninterrupted_run(make_model):
    """The partial-rollout contract from Python: AsyncLLM.abort ends the stream with what was
    generated (tokens, logprobs, routes); resuming with prompt + partial, the same seed, the rest of
    max_tokens and routed_experts_start at the first row not returned continues exactly as the
    uninterrupted run (LLM.generate), tokens, logprobs and routes joined."""
    m0 = make_model("olmoe")
    budget, p = 1500, prompt(11, 4)  # long enough that the abort after the first output lands mid-run
    sp = r3.SamplingParams(max_tokens=budget, temperature=0.9, seed=8, ignore_eos=True)
    whole = r3.LLM(model=m0, enable_return_routed_experts=True, **ENGINE).generate(
        [{"prompt_token_ids": p}], sp)[0].outputs[0]

    async def main():
        engine = r3.AsyncLLM(m0, enable_return_routed_experts=True, **ENGINE)
        outs = []
        async for out in engine.generate({"prompt_token_ids": p}, sp, request_id="partial"):
            outs.append(out)
            if len(outs) == 1:
                assert await engine.abort("partial") == 1
        cut = outs[-1].outputs[0]
        assert outs[-1].finished and cut.finish_reason == "abort" and len(cut.token_ids) < budget
        start = cut.routed_experts_start + cut.routed_experts.shape[0]  # the first row not returned
        rest_sp = r3.SamplingParams(max_tokens=budget - len(cut.token_ids), temperature=0.9, seed=8, ignore_eos=True,
                                    routed_experts_start=start)
        rest = (await collect(engine, p + cut.token_ids, rest_sp, "resumed"))[-1].outputs[0]
        engine.shutdown()
        assert cut.token_ids + rest.token_ids == whole.token_ids
        assert cut.logprobs + rest.logprobs == whole.logprobs
        assert np.array_equal(np.concatenate([cut.routed_experts, rest.routed_experts]), whole.routed_experts)

    asyncio.run(main())


def test_async_llm_with_speculation_streams_what_it_would_without(make_model):
    """AsyncLLM(speculative_algorithm="NGRAM"): streamed outputs (a step may add several tokens)
    end with the tokens, logprobs and routes of the engine without speculation."""
    model = make_model("olmoe")
    sync = r3.LLM(model=model, enable_return_routed_experts=True, **ENGINE)
    sp = r3.SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    prompts = [prompt(8, 20 + i) * 3 for i in range(3)]

    async def main():
        engine = r3.AsyncLLM(model, enable_return_routed_experts=True, speculative_algorithm="NGRAM",
                             speculative_num_draft_tokens=4, **ENGINE)
        runs = await asyncio.gather(*[collect(engine, p, sp, f"s-{i}") for i, p in enumerate(prompts)])
        for p, outs in zip(prompts, runs):
            for a, b in zip(outs, outs[1:]):
                assert b.outputs[0].token_ids[:len(a.outputs[0].token_ids)] == a.outputs[0].token_ids
            want = sync.generate([{"prompt_token_ids": p}], sp)[0].outputs[0]
            got = outs[-1].outputs[0]
            assert got.token_ids == want.token_ids and got.logprobs == want.logprobs
            assert np.array_equal(got.routed_experts, want.routed_experts)

    asyncio.run(main())

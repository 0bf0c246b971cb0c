"""AsyncLLM: the engine on its own thread, driven from asyncio the way verl and NeMo-RL drive
vLLM's AsyncLLM. Every blocking call runs in a worker thread with the GIL released, so the event
loop keeps serving other coroutines."""
import asyncio
import concurrent.futures

from . import _r3


class _ShutDown:
    """What an AsyncLLM holds after shutdown(): every call is an r3.Error saying so."""

    def __getattr__(self, name):
        raise _r3.Error(f"AsyncLLM.{name}: this AsyncLLM was shut down (create a new one)")


class AsyncLLM:
    """r3.AsyncLLM(model, enable_return_routed_experts=False, **engine_args).

    Engine arguments are LLM's (max_num_seqs, max_num_batched_tokens, num_kv_blocks, ...)."""

    def __init__(self, model, enable_return_routed_experts=False, **engine_args):
        self._engine = _r3._AsyncEngine(model, enable_return_routed_experts, **engine_args)
        # Waiting streams hold a worker each while they wait (briefly: they poll).
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=64, thread_name_prefix="r3-async")

    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def generate(self, prompt, sampling_params=None, request_id=None):
        """Yields cumulative RequestOutputs (vLLM's default output kind) until finished.

        prompt: {"prompt_token_ids": [...]} or a list of ids. request_id must be unique among the
        requests in flight (abort takes it)."""
        if request_id is None:
            raise _r3.Error("AsyncLLM.generate needs a request_id")
        stream = await self._run(self._engine.submit, prompt, sampling_params, str(request_id))
        finished = False
        try:
            while True:
                out = await self._run(stream.next, 0.05)
                if out is None:
                    continue
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            # Cancelled, or the consumer stopped iterating: the request must not run on (as in
            # vLLM's AsyncLLM), and its id becomes free again.
            if not finished:
                self._engine.abort(str(request_id))

    async def abort(self, request_id):
        """Aborts the request (its stream ends with finish_reason "abort"); returns how many ran."""
        return await self._run(self._engine.abort, str(request_id))

    async def pause_generation(self, mode="abort"):
        """SGLang's modes: "abort" ends every request, "in_place" keeps them with their KV,
        "retract" frees their KV; no step runs until continue_generation()."""
        await self._run(self._engine.pause_generation, mode)

    async def continue_generation(self):
        await self._run(self._engine.continue_generation)

    async def reset_prefix_cache(self):
        """Drops the prefix cache; False (nothing done) while requests run or wait."""
        return await self._run(self._engine.reset_prefix_cache)

    async def sleep(self, level=1):
        """Gives the KV cache and the packed weights back to the OS (the engine must be idle)."""
        await self._run(self._engine.sleep, level)

    async def wake_up(self, tags=None):
        """Rebuilds what sleep() released: tags ["kv_cache", "weights"] or None for both."""
        await self._run(self._engine.wake_up, tags)

    async def update_weights(self, path, flush_cache=True, weight_version=None):
        """Refit from a checkpoint directory (same model description); returns the refit counter."""
        return await self._run(self._engine.update_weights, path, flush_cache, weight_version)

    async def update_weights_from_tensors(self, named_tensors, flush_cache=True, weight_version=None, finished=True):
        """In-memory refit in buckets, each packed into the served weights as it arrives: from a
        finished=False bucket until the finished=True one, running requests end (abort) and new ones
        are refused; nothing runs on part-old, part-new weights."""
        return await self._run(self._engine.update_weights_from_tensors, named_tensors, flush_cache, weight_version,
                               finished)

    async def get_weight_version(self):
        return self._engine.get_weight_version()

    def shutdown(self):
        self._engine = _ShutDown()
        self._pool.shutdown(wait=False)

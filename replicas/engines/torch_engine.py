"""TorchEngine: the reference decoder behind the Engine protocol, batch-1 or continuously batched.

One background thread owns the model, its KV cache and the sampler, and runs the step loop:

    wait for work -> drop cancelled requests -> admit waiting requests into free KV slots,
    prefilling each (its first token streams out at once) -> one batched decode step for all
    running rows -> sample on the device -> deliver the new tokens to every stream

so that the event loop of the Serve replica never waits on the model. With `max_batch=1` this
is the latency tier's batch-1 engine on machines without the megakernel; with `max_batch>1` it
is the throughput tier's continuously batched engine (requests join and leave between steps).

Device synchronization: a step launches its work and waits for the device once, when it copies
the sampled token ids [B] to the host to stream them (and decide stops). Inputs of the next step
are gathered on the device from the previous step's samples; the small per-step index tensors go
up from pinned memory without blocking; the sampling parameters live on the device from admission.
Each forward gets its attention length (`context_len`) from the host, so the model needs no sync.

Requests are validated as vLLM does: token ids must be in the vocabulary and prompt + max_tokens
must fit the context, else EngineError; the context limit therefore never cuts a generation
short, and LENGTH always means max_tokens was reached. The stop token (eos or a stop id) is
included in the streamed tokens, as generated; the router leaves its text out, as vLLM does (a stop
id's unless `include_stop_str_in_output`, which it does not offer).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity

from megaserve.kernels.profiling import count_kernel_launches, profiling
from megaserve.monitoring.metrics import KERNEL_LAUNCHES_PER_STEP

from ..models import KVCache, load_model
from ..protocol import CoalescePolicy, Tier, context_limit
from ..sampling import SamplingTable, sample, token_logprobs
from .engine_metrics import EngineMetrics
from .stream import StreamOutbox
from .threaded import Admission, StepThreadEngine


ENGINE_LABEL = "torch"
AUTO_DTYPE = "auto"  # the checkpoint's dtype on a GPU, float32 on the CPU (bf16 matmuls crawl there)


class TorchEngine(StepThreadEngine):
    def __init__(
        self,
        model_dir: str | Path,
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | str | None = AUTO_DTYPE,
        max_batch: int = 1,
        max_seq: int | None = None,
        coalesce: CoalescePolicy = CoalescePolicy(),
        tier: Tier | str = Tier.LATENCY,
        model_name: str | None = None,
    ) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {max_batch}")
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"TorchEngine on {str(self.device)!r} needs a CUDA GPU, and this torch sees none")
        if dtype in (None, AUTO_DTYPE):
            dtype = torch.float32 if self.device.type == "cpu" else None
        self.model = load_model(model_dir, self.device, dtype)
        config = self.model.config
        self.vocab_size = config.vocab_size
        self.eos_ids = frozenset(config.eos_token_ids)
        self.max_context = context_limit(max_seq, config.max_position_embeddings)
        self.max_batch = max_batch
        self.model_name = model_name or Path(model_dir).name
        self.tier = Tier(tier).value
        self.coalesce = coalesce
        self.cache: KVCache = self.model.new_cache(max_batch, self.max_context)
        self.sampling = SamplingTable(max_batch, self.vocab_size, self.device)
        self.generator = torch.Generator(device=self.device)
        self.generator.seed()
        self.next_tokens = torch.zeros(max_batch, dtype=torch.int64, device=self.device)  # per slot
        self.metrics = EngineMetrics(self.tier, self.model_name)
        self.launches_per_step = self._measure_launches()
        KERNEL_LAUNCHES_PER_STEP.labels(tier=self.tier, model=self.model_name, engine=ENGINE_LABEL).set(
            self.launches_per_step
        )

        self._running: dict[int, Admission] = {}  # slot -> sequence; engine thread only
        self._free_slots = list(range(max_batch - 1, -1, -1))  # pop() takes slot 0 first
        self._start_step_thread(f"torch-engine-{self.model_name}")

    def _measure_launches(self) -> int:
        """Launches of one batch-1 decode step, counted once with the profiler: CUDA kernels on a
        GPU; on the CPU, the top-level ATen operators dispatched (each would be a kernel launch on
        a GPU). The step writes scratch K/V at slot 0, position 0, which a prefill overwrites."""
        slot = torch.zeros(1, dtype=torch.int64, device=self.device)

        def one_step() -> None:
            with torch.inference_mode():
                self.model.forward(slot[:, None], slot[:, None], self.cache, slot, last_only=True, context_len=1)

        if self.device.type == "cuda":
            return count_kernel_launches(one_step)
        one_step()
        with profiling([ProfilerActivity.CPU]) as prof:
            one_step()
        return sum(1 for event in prof.events() if event.cpu_parent is None and event.name.startswith("aten::"))

    # --- the asyncio side ----------------------------------------------------------------------

    def _running_items(self) -> list[Admission]:
        return list(self._running.values())

    async def shutdown(self) -> None:
        await self._stop_step_thread()
        self.model = self.cache = self.next_tokens = None  # the thread is gone: free the device
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    # --- the engine thread ---------------------------------------------------------------------

    def _step_loop(self) -> None:
        while self._has_work():
            outbox = StreamOutbox()
            self._drop_cancelled()
            self._admit(outbox)
            if self._running and not self._queue.closed:  # a shutdown during the prefills: stop now
                self._decode(outbox)
            outbox.flush()

    def _has_work(self) -> bool:
        """Block while idle; False once shut down."""
        if self._running:
            return not self._queue.closed
        return self._queue.wait()

    def _drop_cancelled(self) -> None:
        for seq in [seq for seq in self._running.values() if seq.stream.cancelled]:
            self._release(seq)

    def _admit(self, outbox: StreamOutbox) -> None:
        while self._free_slots and not self._queue.closed:  # closed: the rest end ABORT unprefilled
            seq = self._queue.pop()
            if seq is None:
                return
            if seq.stream.cancelled:
                continue
            seq.slot = self._free_slots.pop()
            self._running[seq.slot] = seq
            self.sampling.assign(seq.slot, seq.request.sampling)
            self.metrics.request_started()
            self._prefill(seq, outbox)
            outbox.flush()  # time to first token: do not wait for the decode step

    def _prefill(self, seq: Admission, outbox: StreamOutbox) -> None:
        start = time.perf_counter()
        prompt = seq.request.prompt_token_ids
        slot_index = self._to_device([seq.slot])
        input_ids = self._to_device(prompt)[None]  # [1, P]
        positions = torch.arange(len(prompt), device=self.device)[None]  # [1, P]
        logits = self.model.forward(
            input_ids, positions, self.cache, slot_index, last_only=True, context_len=len(prompt)
        )  # [1, V]
        rows = self.sampling.gather([seq.slot], slot_index)
        tokens = sample(logits, rows, self._to_device([len(prompt)]), self.generator)  # [1]
        self.next_tokens.index_copy_(0, slot_index, tokens)
        [logprob] = token_logprobs(logits, tokens, [seq.request.sampling.logprobs])
        token = tokens.item()  # the step's one sync (two with logprobs)
        seconds = time.perf_counter() - start
        self.metrics.prefill_step(seconds)
        self._deliver(seq, token, seconds, outbox, logprob)

    def _decode(self, outbox: StreamOutbox) -> None:
        start = time.perf_counter()
        batch = list(self._running.values())
        slot_index = self._to_device([seq.slot for seq in batch])  # [B]
        positions = self._to_device([seq.next_position for seq in batch])  # [B]
        input_ids = self.next_tokens[slot_index]  # [B], sampled last step, never left the device
        context_len = max(seq.next_position for seq in batch) + 1  # known on the host: no sync
        logits = self.model.forward(
            input_ids[:, None], positions[:, None], self.cache, slot_index, last_only=True, context_len=context_len
        )
        rows = self.sampling.gather([seq.slot for seq in batch], slot_index)
        tokens = sample(logits, rows, positions + 1, self.generator)  # [B]
        self.next_tokens.index_copy_(0, slot_index, tokens)
        logprobs = token_logprobs(logits, tokens, [seq.request.sampling.logprobs for seq in batch])
        token_ids = tokens.tolist()  # the step's one sync (two where a row asked for logprobs)
        seconds = time.perf_counter() - start
        self.metrics.decode_step(seconds)
        for seq, token, logprob in zip(batch, token_ids, logprobs):
            self._deliver(seq, token, seconds, outbox, logprob)

    def _release(self, seq: Admission) -> None:
        if self._running.get(seq.slot) is seq:  # not a later request that took the slot since
            del self._running[seq.slot]
            self._free_slots.append(seq.slot)
            self.metrics.request_ended()

    def _to_device(self, values: Sequence[int]) -> torch.Tensor:
        """int64 [len(values)] on the device; from pinned memory without blocking on a GPU."""
        host = torch.tensor(values, dtype=torch.int64, pin_memory=self.device.type == "cuda")
        return host.to(self.device, non_blocking=True)

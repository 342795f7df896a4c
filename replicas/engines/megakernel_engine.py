"""MegakernelEngine: batch-1 generation whose decode steps are one megakernel launch each.

One background thread owns the GPU, the model, its one-row KV cache and the kernel, and serves
one request at a time (the latency tier's replicas take one request each):

    wait for a request -> prefill the prompt with the reference model's PyTorch ops into the
    KV cache (the kernel reads the same cache) -> first token -> decode steps until a stop
    token, max_tokens, or the consumer cancels

A decode step is the replay of a CUDA graph that holds exactly one kernel launch
(`kernels.launcher.DecodeStep`): the kernel reads its input token and position from device
memory and writes the next ones back, so the same graph serves every step and the only host
sync per step is reading the new token id (to stream it and check stops). Greedy requests take
the kernel's on-GPU argmax; sampled ones run `replicas.sampling.sample` on the kernel's logits
and write the drawn token into the kernel's input slot. A request that asks for logprobs gets them
from the same logits (`replicas.sampling.token_logprobs`: a few PyTorch kernels after the step's
launch, for that request only).

Requests are validated, queued and streamed as in TorchEngine (`threaded.StepThreadEngine`).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from megaserve.kernels.build import KernelCache
from megaserve.kernels.launcher import STATE_POS, DecodeStep, store_transposed
from megaserve.kernels.profiling import count_kernel_launches
from megaserve.kernels.shape import KernelShape
from megaserve.monitoring.metrics import KERNEL_LAUNCHES_PER_STEP

from ..models import ModelConfig, load_model
from ..protocol import CoalescePolicy, Tier, TokenLogprob, context_limit
from ..sampling import SamplingRows, sample, token_logprobs
from .engine_metrics import EngineMetrics
from .stream import StreamOutbox
from .threaded import Admission, StepThreadEngine


ENGINE_LABEL = "megakernel"
KERNEL_DTYPES = (None, "auto", "bfloat16", torch.bfloat16)  # the kernel is written for bf16
SLOT = 0  # the one KV-cache row


class MegakernelEngine(StepThreadEngine):
    def __init__(
        self,
        model_dir: str | Path,
        *,
        kernel_cache: str | Path,
        device: str | torch.device = "cuda",
        dtype: torch.dtype | str | None = None,
        max_seq: int | None = None,
        coalesce: CoalescePolicy = CoalescePolicy(),
        tier: Tier | str = Tier.LATENCY,
        model_name: str | None = None,
    ) -> None:
        device = torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"MegakernelEngine runs on a CUDA device, got {str(device)!r}")
        if not torch.cuda.is_available():
            raise ValueError("MegakernelEngine needs a CUDA GPU, and this torch sees none")
        self.device = device if device.index is not None else torch.device("cuda", torch.cuda.current_device())
        if dtype not in KERNEL_DTYPES:
            raise ValueError(f"MegakernelEngine runs bf16 weights; dtype {dtype!r} is not supported")
        # A shape the kernel cannot take is refused before the weights and the cache take the GPU.
        KernelShape.from_config(ModelConfig.from_hf_dir(model_dir))
        torch.cuda.set_device(self.device)
        self.model = load_model(model_dir, self.device, torch.bfloat16)
        store_transposed(self.model)  # the kernel's layout; the PyTorch prefill reads it as well
        config = self.model.config
        self.vocab_size = config.vocab_size
        self.eos_ids = frozenset(config.eos_token_ids)
        self.max_context = context_limit(max_seq, config.max_position_embeddings)
        self.model_name = model_name or Path(model_dir).name
        self.tier = Tier(tier).value
        self.coalesce = coalesce
        self.cache = self.model.new_cache(1, self.max_context)
        self.step = DecodeStep(self.model, self.cache, SLOT, KernelCache(kernel_cache))
        self.generator = torch.Generator(device=self.device)
        self.generator.seed()
        self._graphs = {greedy: self._capture(greedy) for greedy in (True, False)}
        self.launches_per_step = self._measure_launches()
        KERNEL_LAUNCHES_PER_STEP.labels(tier=self.tier, model=self.model_name, engine=ENGINE_LABEL).set(
            self.launches_per_step
        )
        self.metrics = EngineMetrics(self.tier, self.model_name)

        self._running: Admission | None = None
        self._graph: torch.cuda.CUDAGraph | None = None  # the running request's decode graph
        self._start_step_thread(f"megakernel-engine-{self.model_name}")

    def _capture(self, greedy: bool) -> torch.cuda.CUDAGraph:
        """A CUDA graph of one decode-step launch; position 0 is scratch until a request sets it."""
        self.step.set_position(0, 0)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self.step.launch(greedy)  # loads the module outside the capture
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        self.step.set_position(0, 0)
        with torch.cuda.graph(graph):
            self.step.launch(greedy)
        return graph

    def _measure_launches(self) -> int:
        """Kernels in one greedy decode step, counted once with the profiler."""
        graph = self._graphs[True]

        def one_step() -> None:
            self.step.set_position(0, 0)
            graph.replay()

        return count_kernel_launches(one_step)

    # --- the asyncio side ----------------------------------------------------------------------

    def _running_items(self) -> list[Admission]:
        running = self._running  # read once: the step thread may clear it meanwhile
        return [] if running is None else [running]

    async def shutdown(self) -> None:
        await self._stop_step_thread()
        self._graphs, self._graph = {}, None
        self.step = self.model = self.cache = None  # the thread is gone: free the device
        torch.cuda.empty_cache()

    # --- the engine thread ---------------------------------------------------------------------

    def _step_loop(self) -> None:
        torch.cuda.set_device(self.device)
        while self._queue.wait():
            item = self._queue.pop()
            if item is None or item.stream.cancelled:
                continue
            self._running = item
            self.metrics.request_started()
            if not self._serve(item):
                return  # shut down mid-generation: _abort_all ends the stream
            self._release(item)  # cancelled: _deliver released it otherwise

    def _serve(self, item: Admission) -> bool:
        """Prefill, then decode until a stop condition or cancellation (True: the stream is done),
        or until the engine shuts down (False: the stream is still open)."""
        params = item.request.sampling
        rows = None if params.greedy else SamplingRows.build([params], self.vocab_size, self.device)
        prompt = item.request.prompt_token_ids
        start = time.perf_counter()
        token, logprob = self._prefill(prompt, rows, params.logprobs)
        seconds = time.perf_counter() - start
        self.metrics.prefill_step(seconds)
        if self._stream(item, token, seconds, logprob):
            return True
        self._begin_decode(token, len(prompt), params.greedy)
        while not item.stream.cancelled:
            if self._queue.closed:
                return False
            start = time.perf_counter()
            token, logprob = self._decode_step(rows, params.logprobs)
            seconds = time.perf_counter() - start
            self.metrics.decode_step(seconds)
            if self._stream(item, token, seconds, logprob):
                return True
        return True

    def _stream(self, item: Admission, token: int, seconds: float, logprob: TokenLogprob | None) -> bool:
        """Deliver one token to the client at once; True when it ends the generation."""
        outbox = StreamOutbox()
        done = self._deliver(item, token, seconds, outbox, logprob)
        outbox.flush()
        return done

    # The GPU work of a request: everything else in this class is control flow.

    def _prefill(self, prompt: tuple[int, ...], rows: SamplingRows | None,
                 top: int | None) -> tuple[int, TokenLogprob | None]:
        """The first token of `prompt`'s continuation, and its logprob with `top` alternatives
        (None: not asked for)."""
        ids = torch.tensor([prompt], dtype=torch.int64, device=self.device)
        positions = torch.arange(len(prompt), device=self.device)[None]
        slots = torch.full((1,), SLOT, dtype=torch.int64, device=self.device)
        logits = self.model.forward(
            ids, positions, self.cache, slots, last_only=True, context_len=len(prompt)
        )  # [1, V]; context_len known on the host: no sync before the token's
        if rows is None:
            tokens = logits.argmax(dim=-1)  # [1]
        else:
            tokens = sample(logits, rows, torch.tensor([len(prompt)], device=self.device), self.generator)
        [logprob] = token_logprobs(logits, tokens, [top])
        return tokens.item(), logprob

    def _begin_decode(self, token: int, position: int, greedy: bool) -> None:
        """Make the next decode step feed `token` at `position`, through the graph for `greedy`."""
        self.step.set_position(token, position)
        self._graph = self._graphs[greedy]

    def _decode_step(self, rows: SamplingRows | None, top: int | None) -> tuple[int, TokenLogprob | None]:
        """One decode step (a graph replay); the token it produced, and its logprob with `top`
        alternatives (None: not asked for)."""
        self._graph.replay()
        logits = self.step.logits[None]  # [1, V], a view: no launch
        if rows is None:
            tokens = self.step.next_token.view(1)  # [1] int32, the kernel's argmax: a view, no launch
        else:
            position = self.step.state[STATE_POS : STATE_POS + 1].long()  # [1]: the drawn token's, on the device
            tokens = sample(logits, rows, position, self.generator)
            self.step.token_slot.copy_(tokens[0])
        [logprob] = token_logprobs(logits, tokens, [top])
        return tokens.item(), logprob  # the step's one sync (two with logprobs)

    def _release(self, item: Admission) -> None:
        if self._running is item:
            self._running = None
            self.metrics.request_ended()

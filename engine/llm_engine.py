"""The engine step loop a node drives: add requests, step, abort.

    step():  schedule -> runner.execute -> scheduler.update_from_output -> output processor

Bad input is refused at ``add_request`` with a ``ValueError`` naming the field, before the request
touches any shared state, so one bad request never disturbs the others.  A request the scheduler gives
up on (larger than the whole cache) comes back as a finished output with ``finish_reason="error"``.  If
the forward pass itself fails, the requests of that step end with the error, the blocks they were writing
leave the prefix cache (half-written KV is never served), and the engine keeps serving the others.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence

import torch

from engine.connector.base import ConnectorContext, KVConnectorBase, KVConnectorRole
from engine.connector.null import NullConnector
from engine.connector.params import KVTransferParams
from engine.connector.spec import KVConnectorSpec
from engine.determinism import enable_determinism, kv_fingerprint
from engine.engine_config import EngineConfig
from engine.hashing import AdapterId, HashNamespace
from engine.kv_cache import KVCacheSpec
from engine.lora.manager import LoRAManager
from engine.metrics import SPECS, StatsSnapshot
from engine.model.embedded import ensure_default_model
from engine.model.gguf import GGUFModel
from engine.model.loader import LoadedModel, inspect_model, load_model
from engine.model.quantized import choose_weights, packed_weights
from engine.native import NativeKernels, native_kernels
from engine.native_attention import PrefillKernel
from engine.output_processor import OutputProcessor
from engine.outputs import RequestOutput
from engine.request import Request, RequestStatus
from engine.runner import ModelRunner, StepFailed
from engine.sampler import Sampler
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerOutput
from engine.structured import GrammarCompiler
from engine.tokenizer import Tokenizer
from telemetry.latency import (
    DECODE_TIME,
    PREFILL_TIME,
    REQUEST_LATENCIES,
    REQUEST_LENGTHS,
    LatencyTracker,
    RequestLatency,
)
from telemetry.metrics import Counters, Histogram, HistogramSnapshot
from wire.kv_events import KVCacheEvent
from wire.memory import tune_malloc_for_tensors

logger = logging.getLogger(__name__)


QUEUE_TIME = "request_queue_time_seconds"
# How the error of a request failed with its step begins (the forward pass or a connector call raised).
STEP_FAILED = "model step failed:"


class RequestTimer:
    """The engine's per-request latency histograms (engine/metrics.py), observed from its outputs through
    one ``telemetry`` latency clock per request: the latencies, the prefill and decode phases and the
    lengths, plus the queue time (arrival to admission)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._live: dict[str, tuple[Request, RequestLatency]] = {}
        names = (*REQUEST_LATENCIES, PREFILL_TIME, DECODE_TIME, *REQUEST_LENGTHS, QUEUE_TIME)
        self.latency = LatencyTracker({name: Histogram(SPECS[name]) for name in names})

    def add(self, request: Request) -> None:
        self._live[request.request_id] = (request, self.latency.start(request.arrival_time))

    def observe(self, out: RequestOutput) -> None:
        live = self._live.get(out.request_id)
        if live is None:
            return
        request, latency = live
        now = self.clock()
        if out.new_token_ids:
            latency.tokens(len(out.new_token_ids), now)
        if not out.finished:
            return
        del self._live[out.request_id]
        latency.finish(
            now,
            scheduled=request.admitted_time,
            prompt_tokens=request.num_prompt_tokens,
            generation_tokens=request.num_output_tokens,
        )
        admitted = now if request.admitted_time is None else request.admitted_time
        self.latency.histograms[QUEUE_TIME].observe(admitted - request.arrival_time)

    def snapshot(self) -> dict[str, HistogramSnapshot]:
        return self.latency.snapshot()


def _connector_half(
    spec: KVConnectorSpec | None, role: KVConnectorRole, context: ConnectorContext
) -> KVConnectorBase:
    """The half of the configured connector for ``role``; the no-op connector when none is configured."""
    return NullConnector(role, context) if spec is None else spec.create(role, context)


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        *,
        connectors: tuple[KVConnectorBase, KVConnectorBase] | None = None,
    ) -> None:
        """``connectors`` (scheduler half, worker half) overrides ``config.kv_connector``: tests and the
        conformance kit pass instances they can watch."""
        self.config = config
        device = config.torch_device()
        if device.type == "cpu":
            tune_malloc_for_tensors()  # see wire/memory.py: stops per-op page faults
        model_path = config.model if config.model is not None else ensure_default_model()
        source = inspect_model(model_path)  # refuses a bad folder or file before any weight is read
        self.tokenizer = Tokenizer.for_model(source)
        dtype = config.torch_dtype(device, source.config.checkpoint_dtype)
        logger.info("model %s: %s on %s (%s)", source.path, dtype, device, config.dtype_reason(device))
        types = source.tensor_types if isinstance(source, GGUFModel) else {}
        kernels = native_kernels() if device.type == "cpu" else None
        kernel = kernels.quant if kernels is not None else None
        quantized, weights_note = choose_weights(config.weights, config.dtype, types, device, dtype, kernel)
        logger.info("weights: %s", weights_note)
        self.weights_note = weights_note  # what ran and why (pdkv generate prints it)
        # The cache's size and the longest request, before any weight is read (a refusal costs no load).
        probe = KVCacheSpec.for_model(source.config, num_blocks=1, block_size=config.block_size, dtype=dtype)
        self.kv_spec = dataclasses.replace(probe, num_blocks=config.num_blocks_for(probe.bytes_per_block))
        self.max_model_len, self._context_note = config.context_length(
            source.config.max_position_embeddings, self.kv_spec.num_blocks, self.kv_spec.block_size
        )
        self.model: LoadedModel = load_model(
            source, dtype=dtype, device=device, kernel=kernel, quantized=quantized
        )
        model_config = self.model.config
        self.eos_token_ids = model_config.eos_token_ids
        self.determinism = enable_determinism(
            self.model.model,
            requested=config.deterministic,
            dtype=dtype,
            device=device,
            num_heads=model_config.num_heads,
            num_kv_heads=model_config.num_kv_heads,
            head_dim=model_config.head_dim,
            max_rows=config.max_num_batched_tokens,
            block_size=config.block_size,
        )
        logger.info("deterministic %s", self.determinism.note)
        self.lora = LoRAManager(
            model_config,
            max_loras=config.lora_slots,
            max_cpu_loras=config.cpu_loras,
            max_lora_rank=config.max_lora_rank,
            model=self.model.model,
            dtype=dtype,
            device=device,
            deterministic=self.determinism.on,
        )
        for name, path in config.loras:
            self.lora.add(name, path)
        # the GGUF types the layers' linears run packed (not the bfloat16 kernel's dense "BF16")
        layer_types = frozenset(w.qtype for w in packed_weights(self.model.model.layers)) - {"BF16"}
        self.namespace = HashNamespace(
            model_fingerprint=kv_fingerprint(
                self.model.fingerprint,
                dtype,
                self.determinism.on,
                tiles=self.model.bf16_tiles,
                torch_linears=self.model.torch_linears,
                attention_tiles=self._attention_tiles(kernels, dtype),
                # the layers' linears make the KV bits; a packed LM head or embedding changes none of them
                quantized=bool(layer_types),
                packed_types=layer_types,
                bf16_dot=None if kernels is None else kernels.bf16_dot,
            ),
            block_size=config.block_size,
            algo=config.hash_algo,
        )
        if connectors is None:
            context = ConnectorContext(self.namespace, self.kv_spec, engine_id=config.engine_id)
            spec = config.kv_connector
            connectors = (
                _connector_half(spec, KVConnectorRole.SCHEDULER, context),
                _connector_half(spec, KVConnectorRole.WORKER, context),
            )
        self.scheduler_connector, self.worker_connector = connectors
        self.scheduler = Scheduler(
            config.scheduler_config,
            config.cache_config(self.kv_spec.num_blocks),
            max_model_len=self.max_model_len,
            connector=self.scheduler_connector,
        )
        self.runner = ModelRunner(
            self.model.model,
            self.kv_spec,
            device=device,
            sampler=Sampler(config.seed),
            connector=self.worker_connector,
            deterministic=self.determinism.on,
            lora=self.lora,
        )
        self.lora.in_use = self._adapters_in_use
        self.output_processor = OutputProcessor(self.tokenizer)
        # Structured outputs: constraints compiled once per engine (engine/structured.py).
        self.grammars = GrammarCompiler(self.tokenizer.to_json(), model_config.vocab_size, self.eos_token_ids)
        self.counters = Counters(SPECS)  # the engine's own; the scheduler keeps its counters
        self.timer = RequestTimer()
        # Called with every step the runner executed and its seconds (``pdkv profile`` times steps).
        self.step_observer: Callable[[SchedulerOutput, float], None] | None = None

    def _attention_tiles(self, kernels: NativeKernels | None, dtype: torch.dtype) -> bool:
        """Whether this model's bfloat16 attention runs in AMX tiles (engine/csrc/attn_amx.h): the native
        prefill kernel serves its heads and attends in tiles -- other bits than the vectors', named in
        the namespace.  The switch is set once as the library loads, before any engine exists."""
        if kernels is None or kernels.prefill is None or not kernels.prefill.amx:
            return False
        c = self.model.config
        return PrefillKernel.supports(dtype, c.num_heads, c.num_kv_heads, c.head_dim)

    # -- requests in --------------------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        sampling_params: SamplingParams | None = None,
        *,
        cache_salt: str | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        kv_transfer_params: KVTransferParams | None = None,
        prior_output_token_ids: Sequence[int] = (),
        adapter: str | None = None,
        adapter_digest: bytes | None = None,
    ) -> Request:
        """Validate and queue one request.  Raises ValueError (naming the field) for bad input.

        ``prior_output_token_ids``: output tokens another engine already sampled and streamed as token ids
        (a prefill node's first token).  They must end the prompt; ``sampling_params.max_tokens`` counts
        only the tokens still to sample.  Their text comes out with this request's first output, and stop
        strings see it, so the text continues exactly as on one engine; seeded sampling counts them too, so
        a seeded request draws what one engine would have drawn.  ``adapter``: the name of a LoRA adapter
        this engine serves (``UnknownAdapter`` otherwise); the request runs under it, and its KV is keyed
        by the adapter's content; with ``adapter_digest``, only if it is that content (a prefill and a
        decode node must run the same weights under a name).
        """
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        if self.scheduler.get_request(request_id) is not None or request_id in self.output_processor:
            raise ValueError(f"request_id {request_id!r} is already in use")
        params = sampling_params if sampling_params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        adapter_id = None if adapter is None else self.lora.resolve(adapter, adapter_digest)
        token_ids = self._prompt_token_ids(prompt, scored_only=params.max_tokens == 0)
        prior = list(prior_output_token_ids)
        if prior and (len(prior) >= len(token_ids) or token_ids[-len(prior) :] != prior):
            raise ValueError(
                "prior_output_token_ids must be the last tokens of the prompt, after at least one prompt "
                f"token; got {prior} for a prompt of {len(token_ids)} tokens"
            )
        if not params.ignore_eos and len(self.eos_token_ids) > 1:
            # The request tracks one EOS id; the model's other EOS ids stop it as stop tokens.
            extra = tuple(t for t in self.eos_token_ids[1:] if t not in params.stop_token_ids)
            params = dataclasses.replace(params, stop_token_ids=params.stop_token_ids + extra)
        request = Request(
            request_id,
            token_ids,
            params,
            namespace=self.namespace,
            eos_token_id=self.eos_token_ids[0] if self.eos_token_ids else None,
            cache_salt=cache_salt,
            adapter=adapter_id,
            priority=priority,
            arrival_time=arrival_time if arrival_time is not None else time.monotonic(),
            kv_transfer_params=kv_transfer_params,
            num_prior_output_tokens=len(prior),
        )
        if params.structured is not None:  # compiled already when the driver submitted it (cached)
            request.matcher = self.grammars.matcher(params.structured, prior)
        self.scheduler.add_request(request)
        self.output_processor.add_request(request, prior)
        self.timer.add(request)
        return request

    def _prompt_token_ids(self, prompt: str | Sequence[int], *, scored_only: bool = False) -> list[int]:
        """The prompt's token ids, checked.  ``scored_only`` (max_tokens 0): the prompt may fill the
        context, no output token follows it (a full window scored, as eval harnesses' rolling
        loglikelihood does)."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            token_ids = self.tokenizer.encode(prompt)
        else:
            token_ids = list(prompt)
        if not token_ids:
            raise ValueError("prompt is empty: it has no tokens")
        vocab = self.model.config.vocab_size
        for i, t in enumerate(token_ids):
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
                raise ValueError(f"prompt token id {t!r} at index {i} is outside the vocabulary [0, {vocab})")
        if len(token_ids) > self.max_model_len or (len(token_ids) == self.max_model_len and not scored_only):
            raise ValueError(  # the prompt and at least one output token, unless it is only scored
                f"prompt has {len(token_ids)} tokens: max_model_len {self.max_model_len} "
                f"({self._context_note}) leaves no room for an output token"
            )
        return token_ids

    def _adapters_in_use(self) -> set[AdapterId]:
        return {r.adapter for r in self.scheduler.requests.values() if r.adapter is not None}

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Abort in any state.  Returns the request's final output, or None if it is unknown/finished."""
        if self.scheduler.abort_request(request_id) is None:
            return None
        out = self.output_processor.finish(request_id, "abort")
        if out is not None:
            self._count(out)
        return out

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def has_pending_work(self) -> bool:
        """Unfinished requests, or finished ones whose blocks a connector still holds for a reader."""
        return self.scheduler.has_pending_work()

    def drain(self, timeout_s: float = 30.0) -> bool:
        """Step until no request is unfinished and no connector holds blocks (async saves written,
        sends acknowledged), or ``timeout_s`` passes.  Returns whether the engine is idle."""
        deadline = time.monotonic() + timeout_s
        while self.has_pending_work():
            if time.monotonic() >= deadline:
                return False
            self.step()
            if not self.scheduler.has_unfinished_requests():
                time.sleep(0.001)  # only connector work left: let its threads run instead of spinning
        return True

    def take_kv_events(self) -> list[KVCacheEvent]:
        """The local prefix cache's events followed by the connector's own (its store tiers)."""
        return self.scheduler.kv.take_events() + self.scheduler_connector.take_events()

    def shutdown(self) -> None:
        """Stop the connector halves (threads, sockets, files).  The engine is unusable afterwards."""
        self.worker_connector.shutdown()
        self.scheduler_connector.shutdown()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block hash (benchmarks, tests).  Refused (False) while any block is in use."""
        return self.scheduler.kv.reset_prefix_cache()

    # -- one step -----------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one scheduler step; returns an output for every request that advanced or finished."""
        step = self.scheduler.schedule()
        self.counters.add("engine_steps")
        outputs: list[RequestOutput] = []
        for rid in step.errored_request_ids:
            request = self.output_processor.request(rid)
            error = request.error if request is not None else None
            self._append_finish(outputs, rid, "error", error)
        started = time.perf_counter()
        try:
            # Runs even for an empty step: the connector's async loads and sends report through it.
            result = self.runner.execute(step)
        except Exception as exc:
            cause = exc.__cause__ if isinstance(exc, StepFailed) and exc.__cause__ is not None else exc
            logger.error("model step failed; failing the requests it scheduled", exc_info=cause)
            self._fail_step(outputs, step, f"{STEP_FAILED} {cause!r}")
            if isinstance(exc, StepFailed):
                # The step's requests are finished now; what the connector reported still applies.
                self.scheduler.update_from_output(step, exc.output)
            return outputs
        self._count_step(step, time.perf_counter() - started)
        core = self.scheduler.update_from_output(step, result)
        for out in self.output_processor.process(core.updates, self.scheduler):
            self._count(out)
            outputs.append(out)
        return outputs

    def _count_step(self, step: SchedulerOutput, seconds: float) -> None:
        """The runner's time, and the share of it prefill chunks took (what a router's cost model uses)."""
        if self.step_observer is not None:
            self.step_observer(step, seconds)
        self.counters.add("engine_step_seconds", seconds)
        total = step.total_num_scheduled_tokens
        prefill = sum(sr.num_tokens for sr in step.scheduled if sr.num_tokens > 1)
        if prefill and total:
            self.counters.add("prefill_compute_tokens", prefill)
            self.counters.add("prefill_compute_seconds", seconds * prefill / total)

    def _count(self, out: RequestOutput) -> None:
        """Every output the engine returns passes here once: its counters and latencies."""
        if out.new_token_ids:
            self.counters.add("generation_tokens", len(out.new_token_ids))
        if out.finished:
            self.counters.add(f"request_success.{out.finish_reason or 'unknown'}")
        self.timer.observe(out)

    def _append_finish(self, outputs: list[RequestOutput], rid: str, reason: str, error: str | None) -> None:
        out = self.output_processor.finish(rid, reason, error=error)
        if out is not None:
            self._count(out)
            outputs.append(out)

    def _fail_step(self, outputs: list[RequestOutput], step: SchedulerOutput, error: str) -> None:
        """End every request of a failed forward pass with ``error``; the other requests carry on."""
        bs = self.kv_spec.block_size
        admitted = set(step.new_request_ids)
        for sr in step.scheduled:
            request = self.scheduler.get_request(sr.request_id)
            if request is not None:
                # The blocks this chunk was writing may hold half-written KV, and a request admitted this
                # step may have had blocks loaded by the connector: no later request may hit either.
                start = request.num_local_cached_tokens if sr.request_id in admitted else sr.start_position
                self.scheduler.kv.uncache_from(request, start // bs)
        for sr in step.scheduled:
            self.scheduler.finish_request(sr.request_id, RequestStatus.FINISHED_ERROR, error=error)
            self._append_finish(outputs, sr.request_id, "error", error)

    # -- observability ------------------------------------------------------------------------------------

    def stats(self) -> StatsSnapshot:
        """Every counter, gauge and histogram of the engine and its scheduler (keys: engine/metrics.py)."""
        own = StatsSnapshot(self.counters.snapshot(), {}, self.timer.snapshot())
        return self.scheduler.stats().merged(own)

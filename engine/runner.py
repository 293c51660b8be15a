"""The model runner: one ``SchedulerOutput`` in, one sampled token per finishing chunk out.

    execute(step):
        connector.handle_preemptions(meta); connector.start_load_kv(meta)
        inputs = prepare(step)          flat ragged batch: ids, positions, slots, attention metadata
        hidden = model(inputs)          per layer: wait_for_layer_load, write KV, attend, save_kv_layer
        connector.wait_for_save(); connector.get_finished(...); get_block_ids_with_load_errors()
        tokens = sampler(logits of the rows that sample)

``connector`` is the worker half of the KV connector (``connectors/base.py``): a ``NullConnector`` when
none is configured, so this loop never asks whether one exists.

The runner keeps no per-request state: everything it needs (tokens, positions, block tables) comes with
each step, so preemption, prefix hits and chunked prefill need no bookkeeping here.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.attention import DECODE_GROUP_SIZE, AttentionMetadata, DecodeBatch, GatherWorkspace, PrefillChunk
from engine.connector.base import KVConnectorBase, KVConnectorOutput, KVConnectorRole
from engine.connector.null import NullConnector
from engine.hashing import AdapterId
from engine.kv_cache import KVCacheSpec, allocate_kv_cache
from engine.kv_cache_manager import cdiv
from engine.lora.manager import LoRAManager
from engine.model.fused_decode import FusedDecode
from engine.model.llama import ForwardContext, LlamaForCausalLM
from engine.native import RopeKernel, native_kernels
from engine.native_attention import DecodeKernel, PrefillKernel
from engine.sampler import Sampler, SamplingRow, alternatives
from engine.sampling_params import TopLogprobs
from engine.scheduler.output import ModelRunnerOutput, PromptScores, ScheduledRequest, SchedulerOutput

logger = logging.getLogger(__name__)

# Prompt rows scored at once (prompt_logprobs): a [SCORE_ROWS, vocab] float32 slice of logits at a time.
SCORE_ROWS = 256


class StepFailed(RuntimeError):
    """The forward pass (or the connector around it) raised.  ``output`` holds the connector's report
    for the step, without sampled tokens: the engine fails the step's requests, then applies it."""

    def __init__(self, output: ModelRunnerOutput) -> None:
        super().__init__("model step failed")
        self.output = output


@dataclass(slots=True)
class StepInputs:
    """The device tensors of one step and which rows sample."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    attn: AttentionMetadata
    sample_rows: torch.Tensor  # [R] int64: flat row of each sampling request's last token
    sampling: list[ScheduledRequest]  # the R requests that sample, in sample_rows order
    # Requests scoring their prompt (prompt_targets), with the flat row of their chunk's first token.
    scoring: list[tuple[ScheduledRequest, int]]
    # The rows' LoRA adapters as runs (adapter or None, rows), in row order; empty when none has one.
    adapter_rows: list[tuple[AdapterId | None, int]]


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_spec: KVCacheSpec,
        *,
        device: torch.device,
        sampler: Sampler,
        connector: KVConnectorBase | None = None,
        deterministic: bool = False,
        lora: LoRAManager | None = None,
    ) -> None:
        """``deterministic``: every attention row through the prefill kernel (engine/determinism.py; the
        engine has made the model's linears batch-invariant already)."""
        self.model = model
        self.device = device
        self.kv_spec = kv_spec
        self.block_size = kv_spec.block_size
        self.kv_cache = allocate_kv_cache(kv_spec, device)  # see engine/kv_cache.py for the layout
        self.sampler = sampler
        # The worker half of the KV connector; a NullConnector when none is configured (invariant 9).
        self.connector = connector if connector is not None else NullConnector(KVConnectorRole.WORKER)
        self.connector.register_kv_caches(self.kv_cache)
        self.workspace = GatherWorkspace()
        self.decode_kernel, self.prefill_kernel, self.rope_kernel = self._native_kernels(
            model, kv_spec, device, sampler
        )
        if deterministic and self.prefill_kernel is None:
            raise ValueError("deterministic mode needs the native prefill attention, which is not built here")
        self.deterministic = deterministic
        self.lora = lora  # sets each step's adapter slots and rows (engine/lora/manager.py)

    @staticmethod
    def _native_kernels(
        model: LlamaForCausalLM, kv_spec: KVCacheSpec, device: torch.device, sampler: Sampler
    ) -> tuple[DecodeKernel | None, PrefillKernel | None, RopeKernel | None]:
        """The native kernels (engine/native.py) where they serve this model: the decode and prefill
        attention and RoPE, which the forward context hands to the layers, and the norms', MLPs' and
        greedy sampler's own, set here."""
        c = model.config
        kernels = native_kernels() if device.type == "cpu" else None
        # None without a compiler: the torch ops
        model.use_native(kernels, kv_spec.dtype, packed=FusedDecode.packed(model))
        layer_kernel = kernels.decode_layer if kernels is not None else None
        model.fused_decode = None
        if layer_kernel is not None and FusedDecode.serves(model, kv_spec.dtype):
            model.fused_decode = FusedDecode(model, layer_kernel, kv_spec.dtype)
        sampler.argmax = kernels.argmax if kernels is not None else None
        if kernels is None:
            return None, None, None
        shape = (kv_spec.dtype, c.num_heads, c.num_kv_heads, c.head_dim)
        decode = kernels.decode if DecodeKernel.supports(*shape) else None
        prefill = kernels.prefill if PrefillKernel.supports(*shape) else None  # the build may lack it
        rope = kernels.rope if RopeKernel.supports(kv_spec.dtype, c.head_dim) else None
        return decode, prefill, rope

    @torch.inference_mode()
    def execute(self, step: SchedulerOutput) -> ModelRunnerOutput:
        """One step.  The connector is driven even when nothing is computed: async loads and sends
        started in earlier steps finish, and their completion must be reported."""
        connector = self.connector
        meta = step.kv_connector_metadata
        out = ModelRunnerOutput()
        if step.kv_connector_failed:  # no metadata of its own to hand the worker: nothing runs
            return out
        connector.bind_step_metadata(meta)  # the worker half reads it as step_metadata until get_finished
        try:
            connector.handle_preemptions(meta)  # before this forward can overwrite preempted blocks
            connector.start_load_kv(meta)
            if step.is_empty:
                self._finish_connector_step(step, out)
                return out
            inputs = self.prepare(step.scheduled)
            ctx = ForwardContext(
                self.kv_cache,
                inputs.attn,
                connector,
                self.workspace,
                self.decode_kernel,
                self.rope_kernel,
                self.prefill_kernel,
                self.deterministic,
            )
            if self.lora is not None:
                self.lora.begin_step(inputs.adapter_rows)
            hidden = self.model(inputs.input_ids, inputs.positions, ctx)  # [T, hidden]
        except Exception as exc:
            # The connector's report (finished sends, load errors) must still reach the scheduler, or
            # held blocks stay held and load errors arrive a step late against reused block ids.
            try:
                self._finish_connector_step(step, out)
            except Exception:
                logger.exception("the KV connector failed to finish a failed step")
            raise StepFailed(out) from exc
        self._finish_connector_step(step, out)
        for sr, row in inputs.scoring:
            out.prompt_scores[sr.request_id] = self._score_prompt(hidden, sr, row)
        if not inputs.sampling:
            return out
        # [R, vocab] in the model's dtype: the sampler widens them to float32 where a row needs more than
        # the greedy argmax (which reads bfloat16 as it is)
        logits = self.model.logits(hidden[inputs.sample_rows])
        rows = [
            SamplingRow(sr.sampling_params, sr.output_index, sr.history, sr.matcher) for sr in inputs.sampling
        ]
        sampled = self.sampler(logits, rows)
        for sr, token, logprob, top in zip(
            inputs.sampling, sampled.token_ids, sampled.logprobs, sampled.top_logprobs, strict=True
        ):
            out.sampled_token_ids[sr.request_id] = token
            if logprob is not None:
                out.logprobs[sr.request_id] = logprob
            if top is not None:
                out.top_logprobs[sr.request_id] = top
        return out

    def _score_prompt(self, hidden: torch.Tensor, sr: ScheduledRequest, row: int) -> PromptScores:
        """Each of the chunk's prompt tokens' next token scored: log_softmax of the float32 logits (as the
        sampler's logprobs), in slices of ``SCORE_ROWS`` rows so a long chunk never holds a [T, vocab]
        tensor."""
        targets = sr.prompt_targets or []
        k = sr.sampling_params.prompt_logprobs or 0
        logprobs: list[float] = []
        tops: list[TopLogprobs] = []
        for i in range(0, len(targets), SCORE_ROWS):
            chunk = targets[i : i + SCORE_ROWS]
            logits = self.model.compute_logits(hidden[row + i : row + i + len(chunk)]).float()
            logp = torch.log_softmax(logits, dim=-1)
            picked = logp.gather(1, self._tensor(chunk).unsqueeze(1)).squeeze(1)
            logprobs.extend(picked.tolist())
            if k:  # each position's own, ties as greedy breaks them (never by the slice's shape)
                tops.extend(alternatives(logits, logp, [k] * len(chunk)))
            else:
                tops.extend(() for _ in chunk)
        return PromptScores(sr.start_position + 1, logprobs, tops)

    def _finish_connector_step(self, step: SchedulerOutput, out: ModelRunnerOutput) -> None:
        connector = self.connector
        try:
            connector.wait_for_save()
            sending, recving = connector.get_finished(step.finished_request_ids)
            invalid = connector.get_block_ids_with_load_errors()
        finally:
            connector.bind_step_metadata(None)
        if sending or recving or invalid:
            out.kv_connector_output = KVConnectorOutput(
                finished_sending=sending, finished_recving=recving, invalid_block_ids=invalid
            )

    def prepare(self, scheduled: Sequence[ScheduledRequest]) -> StepInputs:
        """Lay the step out as one flat batch, single-token queries first (see engine/attention.py)."""
        bs = self.block_size
        decodes = sorted((sr for sr in scheduled if sr.num_tokens == 1), key=lambda sr: sr.start_position)
        prefills = [sr for sr in scheduled if sr.num_tokens > 1]
        ids: list[int] = []
        positions: list[int] = []
        slot_blocks: list[int] = []
        sample_rows: list[int] = []
        sampling: list[ScheduledRequest] = []
        scoring: list[tuple[ScheduledRequest, int]] = []

        for row, sr in enumerate(decodes):
            if sr.prompt_targets:
                scoring.append((sr, row))
            p = sr.start_position
            ids.append(sr.token_ids[0])
            positions.append(p)
            slot_blocks.append(sr.block_ids[p // bs])
            if sr.sample:
                sample_rows.append(row)
                sampling.append(sr)
        # The torch path pads each group to its longest context; the native kernel reads no padding.
        size = DECODE_GROUP_SIZE if self.decode_kernel is None else max(len(decodes), 1)
        groups = [(i, decodes[i : i + size], positions[i : i + size]) for i in range(0, len(decodes), size)]
        # every list of the step into one tensor, the step's tensors views of it: one copy, not one per list
        flat: list[int] = []
        group_spans = [(_append(flat, self._decode_table(g, ps)), _append(flat, ps)) for _, g, ps in groups]

        chunk_rows: list[tuple[int, int, int, tuple[int, int]]] = []
        for sr in prefills:
            row_start, start, n = len(ids), sr.start_position, sr.num_tokens
            span = range(start, start + n)
            ids.extend(sr.token_ids)
            positions.extend(span)
            table = sr.block_ids
            slot_blocks.extend(table[p // bs] for p in span)
            chunk_rows.append((row_start, n, start, _append(flat, table[: cdiv(start + n, bs)])))
            if sr.prompt_targets:
                scoring.append((sr, row_start))
            if sr.sample:
                sample_rows.append(row_start + n - 1)
                sampling.append(sr)

        spans = [_append(flat, ints) for ints in (ids, positions, slot_blocks, [p % bs for p in positions])]
        sample_span = _append(flat, sample_rows)
        packed = self._tensor(flat)

        def view(span: tuple[int, int]) -> torch.Tensor:
            return packed[span[0] : span[0] + span[1]]

        decode_groups = [
            DecodeBatch(i, len(g), view(table).view(len(g), -1), view(ps), bs)
            for (i, g, _), (table, ps) in zip(groups, group_spans, strict=True)
        ]
        chunks = [PrefillChunk(row, n, start, view(table)) for row, n, start, table in chunk_rows]
        input_ids, pos, slots, offsets = (view(span) for span in spans)
        attn = AttentionMetadata(
            slot_blocks=slots, slot_offsets=offsets, decodes=decode_groups, prefills=chunks
        )
        adapters: list[tuple[AdapterId | None, int]] = []
        if any(sr.adapter is not None for sr in scheduled):
            adapters = [(sr.adapter, 1) for sr in decodes] + [(sr.adapter, sr.num_tokens) for sr in prefills]
        return StepInputs(input_ids, pos, attn, view(sample_span), sampling, scoring, adapters)

    def _decode_table(self, decodes: Sequence[ScheduledRequest], positions: list[int]) -> list[int]:
        """The group's block tables as one [B, max_blocks] row-major list, padded with block 0 (masked
        out by position)."""
        bs = self.block_size
        max_blocks = max(p // bs + 1 for p in positions)
        table: list[int] = []
        for sr, p in zip(decodes, positions, strict=True):
            used = p // bs + 1
            table.extend(sr.block_ids[:used])
            table.extend([0] * (max_blocks - used))
        return table

    def _tensor(self, values: Sequence[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.device)


def _append(flat: list[int], values: Sequence[int]) -> tuple[int, int]:
    """``values`` onto ``flat``; returns where they went (start, length)."""
    start = len(flat)
    flat.extend(values)
    return start, len(values)

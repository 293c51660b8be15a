"""llama.cpp at its strongest on this CPU, as the peer ``bench.engine --llamacpp`` compares pdkv with.

    python -m bench.llamacpp [--quick] [--json PATH]      (alone: llama.cpp's figures only)

Needs ``llama_cpp`` (llama-cpp-python, built from source: ``pip install llama-cpp-python`` takes 4-7
minutes here; kept out of the default setup and CI).  ``PDKV_LLAMACPP_PATH`` may name a folder it was
installed into with ``pip install --target`` (with ``--no-deps``, add ``diskcache``, which it imports).

The model is the embedded default's weights as a **BF16 GGUF** (the Q4_1 file dequantized; norms stay
F32; llama.cpp's q/k layout kept as the file has it), so both engines read the same bytes per step.
Decoding is batched the way llama.cpp's own server does it: one ``llama_decode`` per step over every
sequence (one token each), flash attention on (its CPU default), 2 threads.  Figures: output tokens/s
at batch 1, 8 and 32 (each sequence has a 128-token prompt, then ``steps`` decode steps), and time to
first token of a 1000-token prompt.

On a CPU with AMX, llama.cpp's AMX backend takes quantized files (Q4_0, Q4_1, Q8_0, K-quants) and, in the
build measured (llama-cpp-python 0.3.36), segfaults in ``ggml_backend_amx_mul_mat`` on the shipped Q4_1
file -- llama.cpp issue 20824, open; an earlier one (PR 16315) says it gave wrong results for Q4_0/Q4_1.
``bench.engine_real`` then runs the Q4_1 file without llama.cpp's extra buffer types (``amx_backend``,
``extra_bufts=False``: neither the AMX nor a repacked layout, its plain CPU kernels), and prints so.
"""

from __future__ import annotations

import ctypes
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.common import medians_in_turns

CONTEXT = 128
PREFILL_TOKENS = 1000


def import_llama_cpp() -> Any:
    extra = os.environ.get("PDKV_LLAMACPP_PATH")
    if extra and extra not in sys.path:
        sys.path.insert(0, extra)
    import llama_cpp

    return llama_cpp


def write_bf16_gguf(src: Path, dst: Path) -> Path:
    """``src`` with every quantized matrix stored as BF16 (same metadata, same tensor layout)."""
    import gguf
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, quants

    reader = GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(dst), arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.file_type"):
            continue
        vtype = field.types[0]
        sub = field.types[1] if vtype == GGUFValueType.ARRAY and len(field.types) > 1 else None
        writer.add_key_value(key, field.contents(), vtype, sub_type=sub)
    writer.add_file_type(int(gguf.LlamaFileType.MOSTLY_BF16))
    for t in reader.tensors:
        array = quants.dequantize(t.data, t.tensor_type)
        if array.ndim == 1 or t.tensor_type == GGMLQuantizationType.F32:
            writer.add_tensor(t.name, np.ascontiguousarray(array, dtype=np.float32))
        else:
            q = GGMLQuantizationType.BF16
            writer.add_tensor(
                t.name, quants.quantize(np.ascontiguousarray(array, dtype=np.float32), q), raw_dtype=q
            )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


_LOG_CALLBACK: Any = None


def _quiet(ll: Any) -> None:
    """Drop llama.cpp's log lines: at its default level it prints per decode call, which costs time."""
    global _LOG_CALLBACK
    if _LOG_CALLBACK is None:
        _LOG_CALLBACK = ll.llama_log_callback(lambda level, text, user_data: None)
        ll.llama_log_set(_LOG_CALLBACK, ctypes.c_void_p(0))


class LlamaCpp:
    """One llama.cpp context with ``n_seq`` sequences, driven through the low-level C API."""

    def __init__(
        self, path: Path, *, n_seq: int, n_ctx: int, threads: int = 2, extra_bufts: bool = True
    ) -> None:
        ll = self.ll = import_llama_cpp()
        _quiet(ll)
        ll.llama_backend_init()
        mparams = ll.llama_model_default_params()
        if not extra_bufts:  # a ctypes Structure takes any attribute: only a field reaches llama.cpp
            if "use_extra_bufts" not in dict(type(mparams)._fields_):
                raise RuntimeError("this llama-cpp-python has no use_extra_bufts: its extra buffers stay on")
            mparams.use_extra_bufts = False
        self.model = ll.llama_model_load_from_file(str(path).encode(), mparams)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        cparams = ll.llama_context_default_params()
        cparams.n_ctx = n_ctx
        cparams.n_batch = max(n_ctx, 1024)
        cparams.n_ubatch = 512
        cparams.n_seq_max = n_seq
        cparams.n_threads = threads
        cparams.n_threads_batch = threads
        if hasattr(cparams, "flash_attn_type"):
            cparams.flash_attn_type = 1  # LLAMA_FLASH_ATTN_TYPE_ENABLED
        elif hasattr(cparams, "flash_attn"):
            cparams.flash_attn = True
        self.ctx = ll.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context")
        self.vocab = ll.llama_model_get_vocab(self.model)
        self.n_vocab = ll.llama_vocab_n_tokens(self.vocab)
        self.batch = ll.llama_batch_init(max(n_ctx, 1024), 0, n_seq)
        self._last: list[int] = []  # each sequence's next token and position (start, steps)
        self._pos: list[int] = []

    def close(self) -> None:
        ll = self.ll
        ll.llama_batch_free(self.batch)
        ll.llama_free(self.ctx)
        ll.llama_model_free(self.model)

    def clear(self) -> None:
        ll = self.ll
        mem = ll.llama_get_memory(self.ctx)
        ll.llama_memory_clear(mem, True)

    def _decode(self, items: list[tuple[int, int, int, bool]]) -> None:
        """items: (token, position, sequence, wants logits)."""
        b = self.batch
        for i, (tok, pos, seq, logits) in enumerate(items):
            b.token[i] = tok
            b.pos[i] = pos
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = seq
            b.logits[i] = logits
        b.n_tokens = len(items)
        rc = self.ll.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")

    def _argmax(self, i: int) -> int:
        logits = self.ll.llama_get_logits_ith(self.ctx, i)
        arr = (ctypes.c_float * self.n_vocab).from_address(ctypes.addressof(logits.contents))
        import numpy as np

        return int(np.frombuffer(arr, dtype=np.float32).argmax())

    def prefill(self, prompts: list[list[int]]) -> list[int]:
        """Each prompt into its own sequence (one decode call each); the greedy next token of each."""
        first = []
        for seq, p in enumerate(prompts):
            self._decode([(t, j, seq, j == len(p) - 1) for j, t in enumerate(p)])
            first.append(self._argmax(len(p) - 1))
        return first

    def start(self, prompts: list[list[int]]) -> None:
        """Each prompt prefilled into its own sequence (the memory cleared first); ``steps`` decodes on
        from their greedy next tokens."""
        self.clear()
        self._last = self.prefill(prompts)
        self._pos = [len(p) for p in prompts]

    def steps(self, n: int) -> list[float]:
        """``n`` more batched decode steps (one token per sequence each); the time of each."""
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            items = zip(self._last, self._pos, strict=True)
            self._decode([(tok, pos, s, True) for s, (tok, pos) in enumerate(items)])
            self._last = [self._argmax(s) for s in range(len(self._last))]
            times.append(time.perf_counter() - t0)
            self._pos = [p + 1 for p in self._pos]
        return times


PAUSE_S = 0.02  # between two engines' turns: neither's idle pool still spinning while the other computes


def decode_in_turns(
    path: Path,
    ours: Callable[[int], list[float]],
    prompts: list[list[int]],
    *,
    rounds: int,
    per_round: int,
    extra_bufts: bool = True,
) -> tuple[float, float]:
    """The median decode step of another engine (``ours(n)`` times its next n steps, its requests already
    decoding) and of llama.cpp over ``prompts``, in turns of ``per_round`` steps.  Returns (ours,
    llama.cpp's) in seconds."""
    ctx = len(prompts) * (CONTEXT + rounds * per_round + 16)
    lc = LlamaCpp(path, n_seq=len(prompts), n_ctx=ctx, extra_bufts=extra_bufts)
    try:
        lc.start(prompts)
        lc.steps(2)  # warm up
        return medians_in_turns(rounds, lambda: ours(per_round), lambda: lc.steps(per_round), pause_s=PAUSE_S)
    finally:
        lc.close()


def ttft_in_turns(
    path: Path, ours: Callable[[], float], prompt: list[int], *, rounds: int = 3, extra_bufts: bool = True
) -> tuple[float, float]:
    """The median time to first token of ``prompt`` of another engine (``ours()``, a cold prefix each
    time) and of llama.cpp (its memory cleared each time), in turns.  Returns (ours, llama.cpp's)."""
    lc = LlamaCpp(path, n_seq=1, n_ctx=len(prompt) + 16, extra_bufts=extra_bufts)

    def theirs() -> list[float]:
        lc.clear()
        t0 = time.perf_counter()
        lc.prefill([prompt])
        return [time.perf_counter() - t0]

    try:
        return medians_in_turns(rounds, lambda: [ours()], theirs, pause_s=PAUSE_S)
    finally:
        lc.close()


def amx_backend() -> bool:
    """This llama.cpp build runs quantized matmuls in AMX tiles on this CPU (its AMX buffer type)."""
    info = import_llama_cpp().llama_print_system_info().decode(errors="replace")
    return "AMX_INT8 = 1" in info


def measure(gguf_bf16: Path, *, steps: int, prompts_for: Any, extra_bufts: bool = True) -> dict[str, float]:
    """llama.cpp's decode tokens/s at batch 1/8/32 and TTFT of a 1000-token prompt; ``extra_bufts``
    False: without its extra weight buffer types (the AMX one, the repacked ones)."""
    out: dict[str, float] = {}
    out["llamacpp_extra_bufts"] = float(extra_bufts)  # 0: its AMX and repacked layouts were off
    for batch in (1, 8, 32):
        lc = LlamaCpp(gguf_bf16, n_seq=batch, n_ctx=batch * (CONTEXT + steps + 8), extra_bufts=extra_bufts)
        try:
            prompts = prompts_for(batch)
            lc.start(prompts)
            lc.steps(2)  # warm up
            lc.start(prompts)
            step = statistics.median(lc.steps(steps))
            out[f"llamacpp_decode_tokens_per_s_b{batch}"] = batch / step
        finally:
            lc.close()
    lc = LlamaCpp(gguf_bf16, n_seq=1, n_ctx=PREFILL_TOKENS + 16, extra_bufts=extra_bufts)
    try:
        [prompt] = prompts_for(1, PREFILL_TOKENS)
        times = []
        for _ in range(3):
            lc.clear()
            t0 = time.perf_counter()
            lc.prefill([prompt])
            times.append(time.perf_counter() - t0)
        out["llamacpp_ttft_1000_ms"] = statistics.median(times) * 1e3
    finally:
        lc.close()
    return out


def main() -> None:
    import tempfile

    from bench.common import Report, parser, random_prompts
    from engine.model.embedded import ensure_default_model

    p = parser(__doc__.splitlines()[0])
    args = p.parse_args()
    report = Report("llamacpp")
    with tempfile.TemporaryDirectory(prefix="pdkv-llamacpp-") as tmp:
        bf16 = write_bf16_gguf(ensure_default_model(), Path(tmp) / "smollm2-bf16.gguf")
        figures = measure(
            bf16,
            steps=8 if args.quick else 24,
            prompts_for=lambda b, n=CONTEXT: random_prompts(b, (n, n), 49152, seed=100 + b, low=20),
        )
    for k, v in figures.items():
        report.figure(k, v)
    report.emit(args.json)


if __name__ == "__main__":
    main()

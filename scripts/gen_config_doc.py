"""Write the option reference of docs/config.md from the ``pdkv`` parsers (pdkv/settings.py: ``reference``).

    python scripts/gen_config_doc.py

Only the part between the markers is rewritten; tests/serving/test_settings.py checks that it lists every
option of every command with its variable.
"""

from __future__ import annotations

from pathlib import Path

from engine.cpu_features import auto_cpu_dtype_note
from pdkv.cli import build_parser
from pdkv.settings import DOC_BEGIN, DOC_END, reference

DOC = Path(__file__).resolve().parent.parent / "docs" / "config.md"
# --dtype's help says what auto picks on this machine's CPU; the page says it for any.
ANY_CPU = (
    "auto = bfloat16 on a CPU with avx512_bf16, amx_bf16 or avx512f/bw/vl (pdkv's native kernels) "
    "(float32 checkpoints stay float32), else float32"
)


def main() -> int:
    text = DOC.read_text(encoding="utf-8")
    head, _, rest = text.partition(DOC_BEGIN)
    _, _, tail = rest.partition(DOC_END)
    options = reference(build_parser()).replace(auto_cpu_dtype_note(), ANY_CPU)
    DOC.write_text(f"{head}{DOC_BEGIN}\n\n{options}\n{DOC_END}{tail}", encoding="utf-8")
    print(f"wrote {DOC}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Write the option reference of docs/config.md from the ``pdkv`` parsers (pdkv/settings.py: ``reference``).

    python scripts/gen_config_doc.py

Only the part between the markers is rewritten; tests/serving/test_settings.py checks that it is what this
script would write (every option of every command, its variable, default and help).
"""

from __future__ import annotations

from pathlib import Path

from pdkv.cli import build_parser
from pdkv.settings import DOC_BEGIN, DOC_END, doc_reference

DOC = Path(__file__).resolve().parent.parent / "docs" / "config.md"


def main() -> int:
    text = DOC.read_text(encoding="utf-8")
    head, _, rest = text.partition(DOC_BEGIN)
    _, _, tail = rest.partition(DOC_END)
    options = doc_reference(build_parser())
    DOC.write_text(f"{head}{DOC_BEGIN}\n\n{options}\n{DOC_END}{tail}", encoding="utf-8")
    print(f"wrote {DOC}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""``python -m dcp_volumes.cli``: the ``dcp-volumes`` command."""

from __future__ import annotations

from dcp_volumes.cli._main import main

if __name__ == "__main__":
    raise SystemExit(main())

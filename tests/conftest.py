"""Session-wide test setup: environment the local servers need before gcsfs is imported."""

from __future__ import annotations

import os

os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")

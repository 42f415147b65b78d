"""Command-line options shared by the commands: the storage flags (``--endpoint-url``,
``--storage-option``, ``--anon``) and the fsspec options built from them, ``--step-pattern``,
and argument types (argparse reports their errors against the flag's name)."""

from __future__ import annotations

import argparse
import json
import math
import re
from typing import Any

from dcp_volumes.errors import ConfigError

__all__ = [
    "add_step_pattern",
    "age_s",
    "gpu_count",
    "key_value",
    "non_negative_float",
    "number",
    "positive_count",
    "positive_float",
    "positive_or_inf",
    "storage_options_for",
    "storage_options_parser",
]

# --------------------------------------------------------------------------------------------
# Storage options shared by the lifecycle commands (ls, latest, info, verify, rm, gc)


def storage_options_parser() -> argparse.ArgumentParser:
    parent = argparse.ArgumentParser(add_help=False)
    g = parent.add_argument_group(
        "storage",
        "fsspec options for the URL. Credentials come from the environment as usual (AWS_*, "
        "GOOGLE_APPLICATION_CREDENTIALS, AZURE_STORAGE_*); keep them off the command line.",
    )
    g.add_argument(
        "--endpoint-url",
        metavar="URL",
        help="object store endpoint (s3: endpoint_url, default $AWS_ENDPOINT_URL_S3 or "
        "$AWS_ENDPOINT_URL; gs: endpoint_url; az: account_url)",
    )
    g.add_argument(
        "--storage-option",
        "-o",
        dest="storage_option",
        action="append",
        default=[],
        type=key_value,
        metavar="KEY=VALUE",
        help="any fsspec option, repeatable; VALUE is read as JSON when it is true/false/null, "
        "a number, an object or a list, else as a string",
    )
    g.add_argument("--anon", action="store_true", help="anonymous access (public buckets)")
    return parent


def key_value(text: str) -> tuple[str, Any]:
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    value: Any = raw
    if (
        raw in ("true", "false", "null")
        or re.fullmatch(r"-?\d+(\.\d+)?", raw)
        or (raw[:1] in ("{", "["))
    ):
        try:
            value = json.loads(raw)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{key}: {raw!r} is not valid JSON") from None
    return key.strip(), value


def storage_options_for(args: argparse.Namespace, url: str) -> dict[str, Any]:
    """fsspec options for ``url`` from the flags and the environment (flags win)."""
    from dcp_volumes.backends import backend_class

    opts = backend_class(url).cli_options(endpoint=args.endpoint_url, anon=args.anon, url=url)
    opts.update(dict(args.storage_option))
    return opts


def add_step_pattern(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--step-pattern",
        metavar="REGEX",
        help="regular expression that reads the step from a checkpoint's directory name "
        r"(group 'step', else group 1; default: step-<N>, step_<N> or <N>)",
    )


# --------------------------------------------------------------------------------------------
# Argument types


def number(text: str) -> float:
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if math.isnan(x):
        raise argparse.ArgumentTypeError("expected a number, got NaN")
    return x


def non_negative_float(text: str) -> float:
    x = number(text)
    if x < 0 or math.isinf(x):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return x


def positive_float(text: str) -> float:
    x = non_negative_float(text)
    if x == 0:
        raise argparse.ArgumentTypeError("must be greater than 0, got 0")
    return x


def positive_or_inf(text: str) -> float:
    x = number(text)
    if x <= 0:
        raise argparse.ArgumentTypeError(f"must be greater than 0 (or inf), got {text}")
    return x


def _whole(text: str, *, minimum: int, what: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if n < minimum:
        raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {n}")
    return n


def gpu_count(text: str) -> int:
    return _whole(text, minimum=1, what="a whole number of GPUs")


def positive_count(text: str) -> int:
    return _whole(text, minimum=1, what="a whole number")


def count_or_zero(text: str) -> int:
    return _whole(text, minimum=0, what="a whole number")


def age_s(text: str) -> float:
    from dcp_volumes.goodput import parse_duration_s

    if re.fullmatch(r"0+(\.0*)?[smhd]?", text.strip()):
        return 0.0
    try:
        return parse_duration_s(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


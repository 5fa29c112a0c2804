"""Schemathesis hooks (SCHEMATHESIS_HOOKS) for the fuzz test: how to generate the custom string
formats the OpenAPI document uses. Each strategy yields values of exactly what the format's
description promises, so the positive-data check holds the daemon to it."""

from __future__ import annotations

import json

import schemathesis
from hypothesis import strategies as st

# An expression the calculator tool evaluates (daemon/tasks/calc.py, tools/calculator.py).
schemathesis.openapi.format(
    "arithmetic-expression",
    st.builds(
        "{} {} {}".format,
        st.integers(-10**6, 10**6),
        st.sampled_from(["+", "-", "*", "//", "%", "**"]),
        st.integers(1, 12),
    ),
)

# The JSON text of a non-empty list of test ids (daemon/tasks/swe.py).
schemathesis.openapi.format(
    "json-test-ids",
    st.lists(st.from_regex(r"\A[a-z_][a-z0-9_/.:]{0,30}\Z"), min_size=1, max_size=3).map(json.dumps),
)

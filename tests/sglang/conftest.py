"""One stack on real SGLang engines (one prefill, one decode) shared by the modules that only serve on it
(test_serving, test_contract): an engine takes a minute to start here. test_lifecycle changes roles and kills
engines, so it starts its own."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from services.cli.stack import Stack
from tests.sglang.realstack import real_stack


@pytest.fixture(scope="package")
def pd_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with real_stack(tmp_path_factory.mktemp("sglang-pd"), prefill=1, decode=1) as s:
        yield s

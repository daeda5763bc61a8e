"""The precisions, once (`cubic_harness.config.PRECISIONS`): every knob's precision values are in it, and the
views other layers keep (the kernels' torch dtypes, TorchRec's type names) agree with it."""

from __future__ import annotations

import torch

from cubic_harness.config import CHOICES, DTYPE_BYTES, PRECISIONS, TORCHREC_TYPES
from cubic_kernels.base import DTYPES
from tests.helpers import require

PRECISION_KNOBS = ("emb_precision", "dense_precision", "comm_precision", "allreduce_comm_precision")


def test_every_precision_a_knob_names_is_in_the_table() -> None:
    for knob in PRECISION_KNOBS:
        assert set(CHOICES[knob]) <= set(PRECISIONS), knob
    assert DTYPE_BYTES == {n: p.bytes for n, p in PRECISIONS.items()}


def test_the_kernels_dtypes_are_the_tables_torch_dtypes() -> None:
    assert {n: getattr(torch, PRECISIONS[n].torch) for n in DTYPES} == DTYPES
    assert all(torch.finfo(dt).bits == 8 * PRECISIONS[n].bytes for n, dt in DTYPES.items())
    assert set(DTYPES) == {n for n, p in PRECISIONS.items() if p.torch}


def test_torchrecs_names_for_each_precision_exist_in_torchrec() -> None:
    require("torchrec")
    from torchrec.distributed.fbgemm_qcomm_codec import CommType
    from torchrec.types import DataType

    for n in CHOICES["emb_precision"]:
        assert getattr(DataType, TORCHREC_TYPES[n]).name == TORCHREC_TYPES[n]
    for n in CHOICES["comm_precision"]:
        assert CommType[TORCHREC_TYPES[n]].name == TORCHREC_TYPES[n]

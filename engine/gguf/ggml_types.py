"""ggml's tensor types: id → (name, elements per block, bytes per block).

The same table as the `gguf` package's `GGML_QUANT_SIZES` (a test holds them equal), kept here
because importing `gguf.constants` pulls in the whole package (~0.1 s of every start) for
one lookup per tensor.
"""
from __future__ import annotations

QK_K = 256

# id: (name, block elements, block bytes), as in ggml.h / gguf-py's constants.py
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    2: ("Q4_0", 32, 2 + 16),
    3: ("Q4_1", 32, 2 + 2 + 16),
    6: ("Q5_0", 32, 2 + 4 + 16),
    7: ("Q5_1", 32, 2 + 2 + 4 + 16),
    8: ("Q8_0", 32, 2 + 32),
    9: ("Q8_1", 32, 4 + 4 + 32),
    10: ("Q2_K", QK_K, 2 + 2 + QK_K // 16 + QK_K // 4),
    11: ("Q3_K", QK_K, 2 + QK_K // 4 + QK_K // 8 + 12),
    12: ("Q4_K", QK_K, 2 + 2 + QK_K // 2 + 12),
    13: ("Q5_K", QK_K, 2 + 2 + QK_K // 2 + QK_K // 8 + 12),
    14: ("Q6_K", QK_K, 2 + QK_K // 2 + QK_K // 4 + QK_K // 16),
    15: ("Q8_K", QK_K, 4 + QK_K + QK_K // 8),
    16: ("IQ2_XXS", QK_K, 2 + QK_K // 4),
    17: ("IQ2_XS", QK_K, 2 + QK_K // 4 + QK_K // 32),
    18: ("IQ3_XXS", QK_K, 2 + QK_K // 4 + QK_K // 8),
    19: ("IQ1_S", QK_K, 2 + QK_K // 8 + QK_K // 16),
    20: ("IQ4_NL", 32, 2 + 16),
    21: ("IQ3_S", QK_K, 2 + QK_K // 4 + QK_K // 8 + QK_K // 32 + 4),
    22: ("IQ2_S", QK_K, 2 + QK_K // 4 + QK_K // 16),
    23: ("IQ4_XS", QK_K, 2 + 2 + QK_K // 2 + QK_K // 64),
    24: ("I8", 1, 1),
    25: ("I16", 1, 2),
    26: ("I32", 1, 4),
    27: ("I64", 1, 8),
    28: ("F64", 1, 8),
    29: ("IQ1_M", QK_K, QK_K // 8 + QK_K // 16 + QK_K // 32),
    30: ("BF16", 1, 2),
    34: ("TQ1_0", QK_K, 2 + 4 * 13),
    35: ("TQ2_0", QK_K, 2 + 64),
    39: ("MXFP4", 32, 1 + 16),
}


class UnknownTensorType(ValueError):
    def __init__(self, type_id: int) -> None:
        super().__init__(f"tensor type {type_id} is unknown to this version of Ebb")
        self.type_id = type_id


def tensor_bytes(type_id: int, n_elems: int) -> tuple[str, int]:
    """The type's name and a tensor's size in bytes; UnknownTensorType for a type this table lacks."""
    try:
        name, block, size = GGML_TYPES[type_id]
    except KeyError:
        raise UnknownTensorType(type_id) from None
    return name, n_elems // block * size

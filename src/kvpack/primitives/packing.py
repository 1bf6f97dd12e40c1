"""Bit packing of integer codes along the last dim, for any width 1-8 and any length.

Codes are packed LSB-first into exactly ceil(n * bits / 8) bytes per row: 3-bit codes are not
padded to 4 bits. Widths 1, 2, 4 and 8 divide a byte and take a shift-and-or fast path.
"""

from __future__ import annotations

import torch

SUPPORTED_BITS = (1, 2, 3, 4, 5, 6, 7, 8)


def packed_length(n: int, bits: int) -> int:
    """Bytes per row for `n` codes of `bits` bits."""
    return (n * bits + 7) // 8


def _check_bits(bits: int) -> None:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {bits}")


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack `codes (..., n)` (integers in [0, 2**bits)) into `(..., ceil(n*bits/8))` uint8."""
    _check_bits(bits)
    if codes.dtype.is_floating_point:
        raise ValueError(f"codes must be an integer tensor, got {codes.dtype}")
    n = codes.shape[-1]
    codes = codes.to(torch.uint8)
    if bits == 8:
        return codes.contiguous()
    if 8 % bits == 0:
        per = 8 // bits
        pad = (-n) % per
        codes = torch.nn.functional.pad(codes, (0, pad)).view(*codes.shape[:-1], -1, per)
        shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=codes.device)
        return (codes << shifts).sum(-1, dtype=torch.uint8)
    # Other widths: 8 codes fill exactly `bits` bytes, assembled in one int64 word per group.
    wide = _word_dtype(bits)
    groups = _pad_to(codes, 8).view(*codes.shape[:-1], -1, 8).to(wide)
    word = (groups << torch.arange(0, 8 * bits, bits, dtype=wide, device=codes.device)).sum(-1, keepdim=True, dtype=wide)
    out = (word >> torch.arange(0, 8 * bits, 8, dtype=wide, device=codes.device)) & 0xFF
    return out.to(torch.uint8).flatten(-2)[..., : packed_length(n, bits)]


def _word_dtype(bits: int) -> torch.dtype:
    """int32 holds 8 codes of up to 3 bits (24 bits) and is faster; wider codes need int64."""
    return torch.int32 if 8 * bits < 32 else torch.int64


def _pad_to(x: torch.Tensor, multiple: int) -> torch.Tensor:
    return torch.nn.functional.pad(x, (0, (-x.shape[-1]) % multiple))


def unpack_bits(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of `pack_bits`: `(..., nbytes)` uint8 -> `(..., n)` uint8 codes."""
    _check_bits(bits)
    if packed.dtype != torch.uint8:
        raise ValueError(f"packed must be uint8, got {packed.dtype}")
    if packed.shape[-1] != packed_length(n, bits):
        raise ValueError(f"expected {packed_length(n, bits)} bytes for {n} codes of {bits} bits, got {packed.shape[-1]}")
    if bits == 8:
        return packed
    mask = (1 << bits) - 1
    if 8 % bits == 0:
        shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
        return ((packed.unsqueeze(-1) >> shifts) & mask).flatten(-2)[..., :n]
    wide = _word_dtype(bits)
    groups = _pad_to(packed, bits).view(*packed.shape[:-1], -1, bits).to(wide)
    word = (groups << torch.arange(0, 8 * bits, 8, dtype=wide, device=packed.device)).sum(-1, keepdim=True, dtype=wide)
    codes = (word >> torch.arange(0, 8 * bits, bits, dtype=wide, device=packed.device)) & mask
    return codes.to(torch.uint8).flatten(-2)[..., :n]

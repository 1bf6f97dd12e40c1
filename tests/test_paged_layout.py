"""Reading a paged KV cache through the layout its own writer reveals (kvpack.serve.paged_layout)."""

import pytest
import torch

from kvpack.serve.paged_layout import PlaneLayout, probe_layout

H, BS, D = 3, 128, 64


def _planes(kv):
    return kv.view(kv.shape[0], kv.shape[1], 2, BS, D)  # per (block, head): K region, V region


def row_major(key, value, kv):
    """Slot-major rows, K region then V region: the order the connector used to assume."""
    p = _planes(kv)
    p[0, :, 0] = key.transpose(0, 1)
    p[0, :, 1] = value.transpose(0, 1)


def k_transposed(key, value, kv):
    """vLLM's CPU "vec" backend: K as head_dim x block_size, V by slot."""
    p = _planes(kv)
    p[0, :, 0] = key.permute(1, 2, 0).reshape(H, BS, D)
    p[0, :, 1] = value.transpose(0, 1)


def pair_tiled(key, value, kv):
    """An AMX-like tiling: K in slot pairs per channel, V in channel pairs per slot."""
    p = _planes(kv)
    p[0, :, 0] = key.transpose(0, 1).reshape(H, BS // 2, 2, D).transpose(2, 3).reshape(H, BS, D)
    p[0, :, 1] = value.transpose(0, 1).reshape(H, BS, D // 2, 2).transpose(2, 3).reshape(H, BS, D)


@pytest.mark.parametrize("writer", [row_major, k_transposed, pair_tiled])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_reads_what_the_writer_stored_and_scatter_writes_it_back(writer, dtype):
    layout = probe_layout(writer, H, BS, D, dtype)
    key, value = torch.randn(BS, H, D).to(dtype), torch.randn(BS, H, D).to(dtype)
    kv = torch.zeros(4, H, BS, 2 * D, dtype=dtype)
    writer(key, value, kv[2:3])  # block 2 holds the tokens, in the writer's order
    off = torch.tensor([5, 0, 127, 64])
    blk = torch.full_like(off, 2)
    k, v = layout.gather(kv, blk, off)
    assert torch.equal(k, key[off]) and torch.equal(v, value[off])
    other = torch.zeros_like(kv)
    layout.scatter(other, torch.full((BS,), 1), torch.arange(BS), key, value)
    assert torch.equal(other[1], kv[2]) and not other[[0, 2, 3]].any()  # the writer's exact bytes, in block 1 only


def test_content_split_is_k_then_v_along_each_slot_row():
    layout = PlaneLayout.content_split(BS, D)
    kv = torch.randn(2, H, BS, 2 * D)
    k, v = layout.gather(kv, torch.tensor([1, 0]), torch.tensor([3, 9]))
    assert torch.equal(k[0], kv[1, :, 3, :D]) and torch.equal(v[1], kv[0, :, 9, D:])


def test_a_writer_that_loses_entries_is_refused():
    def quantizing(key, value, kv):  # two channels share one entry, like a packed or quantized cache
        p = _planes(kv)
        p[0, :, 0, :, : D // 2] = key.transpose(0, 1)[..., ::2]
        p[0, :, 1] = value.transpose(0, 1)

    with pytest.raises(NotImplementedError, match="each \\(slot, channel\\) once"):
        probe_layout(quantizing, H, BS, D, torch.float32)

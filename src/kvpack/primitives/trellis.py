"""Bitshift trellis-coded quantization (TCQ): a vector quantizer for rotated coordinates, pure torch.

The scalar Lloyd-Max quantizer TurboQuant uses sits 1.45-2.4x above the Shannon bound 4^-b per coordinate at b bits
(a vector codec can sit below it at equal bits). A bitshift trellis (as in QTIP, Tseng et al.
2024) codes a sequence of n coordinates with one bit string: the state before coordinate i is the last L bits read,
each coordinate shifts k = b new bits in, and coordinate i is reconstructed as `codebook[state_i]`, a table of 2^L
values. Decoding is a table lookup per coordinate from a window of the bit string, as TurboQuant's centroid lookup is
(so scores and weighted sums can run on the codes the same way); encoding is a Viterbi search over the 2^L states for
the bit string of least squared error, which a scalar quantizer cannot do: it spends the code space on sequences.

Bits: the first state's L bits, then k per further coordinate: `L + (n - 1)·k` for n coordinates (at n = 64, L = 8,
k = 2: 2.09 bits per value). Stateless functions; tensors `(..., n)` of coordinates, batched over the leading dims.
"""

from __future__ import annotations

import functools

import torch


def _check(codebook: torch.Tensor, k: int) -> int:
    """L (the state width) of a `(2**L,)` codebook for k bits per coordinate."""
    size = codebook.numel()
    state_bits = size.bit_length() - 1
    if codebook.dim() != 1 or size != 1 << state_bits:
        raise ValueError(f"codebook must be 1-D with 2**L entries, got shape {tuple(codebook.shape)}")
    if not 1 <= k < state_bits:
        raise ValueError(f"k (bits per coordinate) must be in 1..L-1 = 1..{state_bits - 1}, got {k}")
    return state_bits


def viterbi(x: torch.Tensor, codebook: torch.Tensor, k: int, wrap: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The least-squared-error state path through the bitshift trellis.

    x: `(N, n)` float; codebook `(2**L,)`; k bits per coordinate. Returns (states `(N, n)` int64, each in
    [0, 2**L) with `states[:, i + 1] >> k == states[:, i] & (2**(L-k) - 1)`, and the squared error `(N,)` float64 of
    `codebook[states]` against x). `wrap (N,)`: the paths must start in a state whose high L - k bits are `wrap` and
    end in one whose low L - k bits are (a tail-biting path: its bit string read as a circle, n·k bits in all).
    Memory: `(N, n, 2**(L-k))` uint8/int16 back-pointers."""
    state_bits = _check(codebook, k)
    tail = 1 << (state_bits - k)
    book = codebook.double()
    x = x.double()
    cost = (x[:, :1] - book) ** 2  # (N, S): every first state is free, or those that continue `wrap`
    ids = torch.arange(1 << state_bits, device=x.device)
    if wrap is not None:
        cost = cost.masked_fill((ids >> k)[None] != wrap[:, None], float("inf"))
    back = []
    for i in range(1, x.shape[1]):
        # State s is entered from the 2^k states p with p & (tail - 1) == s >> k: fold the high k bits of p away.
        folded = cost.view(-1, 1 << k, tail)  # p = hi * tail + lo
        best, arg = folded.min(dim=1)  # (N, tail): best predecessor per low part lo
        back.append(arg.to(torch.uint8 if k <= 8 else torch.int16))
        cost = best.repeat_interleave(1 << k, dim=1) + (x[:, i : i + 1] - book) ** 2  # s = lo << k | new
    if wrap is not None:
        cost = cost.masked_fill((ids & (tail - 1))[None] != wrap[:, None], float("inf"))
    err, last = cost.min(dim=1)
    states = torch.empty(x.shape, dtype=torch.int64, device=x.device)
    states[:, -1] = last
    for i in range(x.shape[1] - 1, 0, -1):
        lo = states[:, i] >> k  # the predecessor's low L-k bits
        hi = back[i - 1].gather(1, lo[:, None]).squeeze(1).long()
        states[:, i - 1] = hi * tail + lo
    return states, err


def to_bits(states: torch.Tensor, k: int, state_bits: int) -> torch.Tensor:
    """The bit string of a state path: `(N, L + (n-1)·k)` uint8 0/1, the first state's L bits then each step's k new
    bits, most significant first (what a packed code stores)."""
    first = (states[:, :1] >> torch.arange(state_bits - 1, -1, -1, device=states.device)) & 1
    new = states[:, 1:, None] >> torch.arange(k - 1, -1, -1, device=states.device) & 1  # low k bits of each next state
    return torch.cat([first, new.flatten(1)], dim=1).to(torch.uint8)


def decode(bits: torch.Tensor, codebook: torch.Tensor, k: int) -> torch.Tensor:
    """Coordinates `(N, n)` float32 from bit strings `(N, L + (n-1)·k)`: coordinate i reads the L-bit window starting at
    bit i·k and looks it up. Each coordinate is independent of the others (no sequential state walk)."""
    state_bits = _check(codebook, k)
    width = bits.shape[1]
    if (width - state_bits) % k:
        raise ValueError(f"a bit string holds L + (n-1)·k bits (L={state_bits}, k={k}), got {width}")
    n = (width - state_bits) // k + 1
    windows = bits.long().unfold(1, state_bits, k)[:, :n]  # (N, n, L)
    weights = 1 << torch.arange(state_bits - 1, -1, -1, device=bits.device)
    return codebook.float()[(windows * weights).sum(-1)]


def train_codebook(x: torch.Tensor, k: int, state_bits: int, iters: int = 6, seed: int = 0) -> torch.Tensor:
    """A `(2**state_bits,)` codebook fitted to training sequences `x (N, n)` by alternating Viterbi paths and per-state
    means (Lloyd's algorithm over the trellis), started from the data's quantiles in a random order (so neighbouring
    states, which share bits, do not hold neighbouring values). States no sequence visits keep their value."""
    gen = torch.Generator().manual_seed(seed)
    size = 1 << state_bits
    levels = torch.quantile(x.flatten().double().cpu(), (torch.arange(size, dtype=torch.float64) + 0.5) / size)
    book = levels[torch.randperm(size, generator=gen)].to(x.device)
    for _ in range(iters):
        states, _ = viterbi(x, book, k)
        total = torch.zeros(size, dtype=torch.float64, device=x.device).index_add_(0, states.flatten(), x.double().flatten())
        count = torch.zeros(size, dtype=torch.float64, device=x.device).index_add_(0, states.flatten(), torch.ones_like(x, dtype=torch.float64).flatten())
        book = torch.where(count > 0, total / count.clamp_min(1), book)
    return book.float()


def bits_per_value(n: int, k: int, state_bits: int) -> float:
    """Stored bits per coordinate of a length-n sequence: `(L + (n-1)·k) / n`."""
    return (state_bits + (n - 1) * k) / n


# -- codes as a cache stores them: k-bit symbols, the state a window of L/k of them ---------------------------------------
def _symbols(k: int, state_bits: int) -> int:
    if state_bits % k:
        raise ValueError(f"a stored trellis needs L a multiple of k (whole k-bit symbols per state), got L={state_bits}, k={k}")
    return state_bits // k


@functools.lru_cache(maxsize=16)
def gaussian_codebook(k: int, state_bits: int) -> torch.Tensor:
    """The `(2**L,)` codebook for N(0, 1) coordinates at k bits per coordinate, fitted once (fixed seed and training
    sequences, so every process builds the same table; 2-6 s) and shared, as a Lloyd-Max table is."""
    return train_codebook(torch.randn(2048, 64, generator=torch.Generator().manual_seed(1)), k, state_bits)


ENCODE_ROWS = 1 << 16  # sequences per batched Viterbi search: 256 MiB of float64 costs at L = 9


def encode_symbols(y: torch.Tensor, codebook: torch.Tensor, k: int) -> torch.Tensor:
    """Coordinates `(..., n)` -> `(..., n)` uint8 k-bit symbols of a tail-biting path: n·k bits, the scalar code's
    size. State i is the window of L/k symbols ending at symbol i, read around the circle (state 0's high bits are
    the last symbols). Two Viterbi passes (QTIP's tail-biting approximation): a free one over the sequence rotated by
    n/2, so the wrap-around point sits mid-path where the search has context on both sides, reads the bits the path
    holds there; the second, over the sequence itself, is held to them at both ends."""
    state_bits = _check(codebook, k)
    _symbols(k, state_bits)
    flat = y.reshape(-1, y.shape[-1])
    half = flat.shape[1] // 2
    out = []
    for rows in flat.split(ENCODE_ROWS):  # bounded temporaries: (rows, 2**L) costs, (rows, n, 2**(L-k)) back-pointers
        free, _ = viterbi(rows.roll(-half, dims=1), codebook, k)  # position j holds coordinate (j + half) mod n
        wrap = free[:, rows.shape[1] - half - 1] & ((1 << (state_bits - k)) - 1)  # the state of coordinate n - 1
        states, _ = viterbi(rows, codebook, k, wrap=wrap)
        out.append((states & ((1 << k) - 1)).to(torch.uint8))
    return torch.cat(out).view(y.shape) if out else torch.empty(y.shape, dtype=torch.uint8, device=y.device)


def decode_symbols(symbols: torch.Tensor, codebook: torch.Tensor, k: int) -> torch.Tensor:
    """`(..., n)` symbols of a tail-biting path -> coordinates `(..., n)` float32: each state read from its window
    (wrapping around), looked up."""
    state_bits = _check(codebook, k)
    per = _symbols(k, state_bits)
    circle = torch.cat([symbols[..., symbols.shape[-1] - (per - 1) :], symbols], dim=-1)
    windows = circle.long().unfold(-1, per, 1)  # (..., n, per)
    states = (windows << (k * torch.arange(per - 1, -1, -1, device=symbols.device))).sum(-1)
    return codebook.to(symbols.device).float()[states]


# -- the kernels' view: a table indexed by the raw window of the packed bit string -------------------------------------
# `pack_bits` stores symbol i at bits k·i .. k·i + k - 1 of a row, least significant first, so the L bits starting at
# bit k·(i - L/k + 1) (around the circle) hold state i's symbols oldest-lowest: the reverse of the state's own order
# (oldest-highest, `decode_symbols`). A kernel reads that window with one shift and mask and indexes a table
# reordered once (`window_table`), so it never assembles states symbol by symbol.
def window_table(codebook: torch.Tensor, k: int) -> torch.Tensor:
    """`(2**L,)` table t with t[window] = codebook[state] for the state whose symbols the raw window holds in reverse
    order: what `window_indices` indexes."""
    state_bits = _check(codebook, k)
    per = _symbols(k, state_bits)
    w = torch.arange(1 << state_bits, device=codebook.device)
    mask = (1 << k) - 1
    state = sum(((w >> (k * j)) & mask) << (k * (per - 1 - j)) for j in range(per))
    return codebook[state]


def window_indices(symbols: torch.Tensor, k: int, state_bits: int) -> torch.Tensor:
    """`(..., n)` k-bit symbols -> `(..., n)` int64 window values: coordinate i's L bits of the circular bit string
    starting at symbol i - L/k + 1, the oldest symbol in the lowest bits (the kernels' table index)."""
    per = _symbols(k, state_bits)
    n = symbols.shape[-1]
    idx = torch.arange(n, device=symbols.device)
    out = torch.zeros(symbols.shape, dtype=torch.int64, device=symbols.device)
    for j in range(per):  # symbol j of the window sits at bits k·j
        out |= symbols.long()[..., (idx - per + 1 + j) % n] << (k * j)
    return out

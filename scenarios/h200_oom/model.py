"""A Llama-shaped decoder with random weights and a KV cache that grows with batch x length.

No downloads: the weights are drawn on the device. The cache holds one slot per
running request and grows in time chunks of `chunk_tokens` positions, one
tensor per (layer, chunk) of shape [2, slots, kv_heads, chunk, head_dim]: its
memory is slots x (longest context, rounded up to a chunk) x KV bytes per token,
so it grows as the batch generates and shrinks when the batch is cut or the
longest requests finish. Every resize goes one (layer, chunk) tensor at a time
and hands the freed memory back to the driver at once, so a shrink never needs
more than one small tensor of headroom and NVML sees the drop.

Decode attention runs over the chunks with one fp32 softmax across all of them
(scores of each chunk, masked past each slot's new token), so no padded copy of
the cache is ever made.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class ModelShape:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    rope_theta: float = 500_000.0

    @property
    def kv_bytes_per_token(self) -> int:
        """2 x layers x kv_heads x head_dim x 2 bytes (bf16), the formula DESIGN.md gives."""
        return 2 * self.layers * self.kv_heads * self.head_dim * 2

    @property
    def params(self) -> int:
        per_layer = (
            self.hidden * (self.heads + 2 * self.kv_heads) * self.head_dim
            + self.heads * self.head_dim * self.hidden
            + 3 * self.hidden * self.intermediate
            + 2 * self.hidden
        )
        return self.layers * per_layer + 2 * self.vocab * self.hidden + self.hidden


LLAMA_8B = ModelShape(layers=32, hidden=4096, heads=32, kv_heads=8, head_dim=128, intermediate=14336, vocab=128256)
TINY = ModelShape(layers=2, hidden=128, heads=4, kv_heads=2, head_dim=32, intermediate=256, vocab=512)


class LlamaModel:
    def __init__(self, shape: ModelShape, device: torch.device, dtype: torch.dtype, seed: int = 0) -> None:
        self.shape = shape
        self.device = device
        self.dtype = dtype
        gen = torch.Generator(device=device).manual_seed(seed)
        s = shape
        std = 0.02

        def weight(*dims: int) -> torch.Tensor:
            return (torch.randn(*dims, generator=gen, device=device, dtype=dtype) * std).contiguous()

        qkv_out = (s.heads + 2 * s.kv_heads) * s.head_dim
        self.embed = weight(s.vocab, s.hidden)
        self.layers = [
            {
                "wqkv": weight(s.hidden, qkv_out),
                "wo": weight(s.heads * s.head_dim, s.hidden),
                "w13": weight(s.hidden, 2 * s.intermediate),
                "w2": weight(s.intermediate, s.hidden),
                "norm1": torch.ones(s.hidden, device=device, dtype=dtype),
                "norm2": torch.ones(s.hidden, device=device, dtype=dtype),
            }
            for _ in range(s.layers)
        ]
        self.final_norm = torch.ones(s.hidden, device=device, dtype=dtype)
        self.lm_head = weight(s.hidden, s.vocab)
        half = s.head_dim // 2
        self.inv_freq = 1.0 / (s.rope_theta ** (torch.arange(0, half, device=device, dtype=torch.float32) / half))

    # ------------------------------------------------------------------ pieces

    def _rotation(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for positions [..., n], shaped [..., n, 1, head_dim / 2]; shared by every layer."""
        freqs = positions.to(torch.float32).unsqueeze(-1) * self.inv_freq
        return freqs.cos().unsqueeze(-2).to(self.dtype), freqs.sin().unsqueeze(-2).to(self.dtype)

    @staticmethod
    def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [..., n, heads, head_dim] (rotate-half form)."""
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), weight, eps=1e-5)

    def _mlp(self, x: torch.Tensor, layer: dict[str, torch.Tensor]) -> torch.Tensor:
        gate, up = (self._norm(x, layer["norm2"]) @ layer["w13"]).chunk(2, dim=-1)
        return x + (F.silu(gate) * up) @ layer["w2"]

    def _qkv(self, x: torch.Tensor, layer: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        s = self.shape
        qkv = self._norm(x, layer["norm1"]) @ layer["wqkv"]
        widths = [s.heads * s.head_dim, s.kv_heads * s.head_dim, s.kv_heads * s.head_dim]
        q, k, v = torch.split(qkv, widths, dim=-1)
        lead = x.shape[:-1]
        return (
            q.reshape(*lead, s.heads, s.head_dim),
            k.reshape(*lead, s.kv_heads, s.head_dim),
            v.reshape(*lead, s.kv_heads, s.head_dim),
        )

    # ------------------------------------------------------------------ prefill

    def prefill(self, tokens: torch.Tensor, cache: KvCache, slots: list[int]) -> torch.Tensor:
        """Prompts of one length, tokens [n, T]; writes their KV at positions [0, T).

        Returns the logits of each prompt's last position, [n, vocab].
        """
        s = self.shape
        n, length = tokens.shape
        cos, sin = self._rotation(torch.arange(length, device=self.device).expand(n, length))
        slot_index = torch.tensor(slots, device=self.device, dtype=torch.long)
        x = self.embed[tokens]
        for index, layer in enumerate(self.layers):
            q, k, v = self._qkv(x, layer)
            q = self._rope(q, cos, sin)
            k = self._rope(k, cos, sin)
            cache.write_prompt(index, slot_index, k, v)
            attn = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
            )
            x = x + attn.transpose(1, 2).reshape(n, length, s.heads * s.head_dim) @ layer["wo"]
            x = self._mlp(x, layer)
        return self._norm(x[:, -1], self.final_norm) @ self.lm_head

    # ------------------------------------------------------------------ decode

    def decode(self, tokens: torch.Tensor, cache: KvCache, lengths: list[int]) -> torch.Tensor:
        """One token per slot (tokens [slots]); slot i holds lengths[i] cached positions (0: empty slot).

        The new token's K and V go into the cache at position lengths[i] before attention, which then
        covers positions [0, lengths[i]]. Returns logits [slots, vocab]; the caller grows the cache to
        hold max(lengths) + 1 positions first.
        """
        s = self.shape
        slots = cache.slots
        group = s.heads // s.kv_heads
        scale = 1.0 / math.sqrt(s.head_dim)
        cos, sin = self._rotation(torch.tensor(lengths, device=self.device, dtype=torch.long))
        mask = cache.decode_mask(lengths)
        where = cache.decode_positions(lengths)
        x = self.embed[tokens]
        for index, layer in enumerate(self.layers):
            q, k, v = self._qkv(x, layer)
            q = self._rope(q, cos, sin)
            k = self._rope(k, cos, sin)
            cache.write_decode(index, where, k, v)
            qg = q.view(slots, s.kv_heads, group, s.head_dim)
            chunks = cache.chunks[index]
            scores = torch.cat([torch.matmul(qg, kc[0].transpose(-1, -2)) for kc in chunks], dim=-1)
            probs = torch.softmax(scores.float() * scale + mask, dim=-1).to(self.dtype)
            width = cache.chunk_tokens
            out = torch.matmul(probs[..., :width], chunks[0][1])
            for c in range(1, len(chunks)):
                out = out + torch.matmul(probs[..., c * width : (c + 1) * width], chunks[c][1])
            x = x + out.reshape(slots, s.heads * s.head_dim) @ layer["wo"]
            x = self._mlp(x, layer)
        return self._norm(x, self.final_norm) @ self.lm_head


class KvCache:
    """Per (layer, chunk) tensors [2, slots, kv_heads, chunk_tokens, head_dim]; see the module doc."""

    def __init__(
        self, shape: ModelShape, slots: int, chunk_tokens: int, device: torch.device, dtype: torch.dtype
    ) -> None:
        self.shape = shape
        self.slots = slots
        self.chunk_tokens = chunk_tokens
        self.device = device
        self.dtype = dtype
        self.chunks: list[list[torch.Tensor]] = [[] for _ in range(shape.layers)]

    @property
    def num_chunks(self) -> int:
        return len(self.chunks[0])

    @property
    def capacity_tokens(self) -> int:
        return self.num_chunks * self.chunk_tokens

    def bytes_for(self, slots: int, chunks: int) -> int:
        return slots * chunks * self.chunk_tokens * self.shape.kv_bytes_per_token

    @property
    def nbytes(self) -> int:
        return self.bytes_for(self.slots, self.num_chunks)

    def _new_chunk(self, slots: int) -> torch.Tensor:
        s = self.shape
        return torch.zeros(2, slots, s.kv_heads, self.chunk_tokens, s.head_dim, device=self.device, dtype=self.dtype)

    def ensure_positions(self, tokens: int) -> None:
        """Grow (in whole chunks, every layer) until `tokens` positions fit."""
        while self.capacity_tokens < tokens:
            for layer_chunks in self.chunks:
                layer_chunks.append(self._new_chunk(self.slots))

    def trim_positions(self, tokens: int) -> bool:
        """Free trailing chunks no slot reaches; True when memory was freed."""
        keep = max(1, -(-tokens // self.chunk_tokens))
        if self.num_chunks <= keep:
            return False
        for layer_chunks in self.chunks:
            del layer_chunks[keep:]
        release()
        return True

    def resize_slots(self, keep: list[int], slots: int) -> None:
        """Keep the slots `keep` (in that order, as slots 0..len-1) in a cache of `slots` slots."""
        if len(keep) > slots:
            raise ValueError("more slots kept than the new size holds")
        index = torch.tensor(keep, device=self.device, dtype=torch.long)
        placeholder = torch.empty(0, device=self.device, dtype=self.dtype)
        for layer_chunks in self.chunks:
            for c in range(len(layer_chunks)):
                kept = layer_chunks[c].index_select(1, index) if keep else None
                # Free the old tensor before the new one exists, and hand it back to the driver at once:
                # a shrink needs one tensor of headroom, not a second cache, and NVML sees the drop.
                layer_chunks[c] = placeholder
                release()
                if kept is not None and len(keep) == slots:
                    layer_chunks[c] = kept
                    continue
                new = self._new_chunk(slots)
                if kept is not None:
                    new[:, : len(keep)] = kept
                del kept
                layer_chunks[c] = new
        self.slots = slots

    def drop_all(self) -> None:
        self.chunks = [[] for _ in range(self.shape.layers)]
        release()

    def write_prompt(self, layer: int, slot_index: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [n, T, kv_heads, head_dim] for positions [0, T) of the slots in `slot_index`."""
        length = k.shape[1]
        kv = torch.stack((k, v)).transpose(2, 3)  # [2, n, kv_heads, T, head_dim]
        for c, chunk in enumerate(self.chunks[layer]):
            start = c * self.chunk_tokens
            if start >= length:
                break
            end = min(length, start + self.chunk_tokens)
            chunk[:, :, :, : end - start].index_copy_(1, slot_index, kv[:, :, :, start:end])

    def decode_positions(self, lengths: list[int]) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
        """Where each slot's new token goes: (chunk, slot indices, offsets) per chunk touched."""
        groups: dict[int, tuple[list[int], list[int]]] = {}
        for slot, position in enumerate(lengths):
            chunk, offset = divmod(position, self.chunk_tokens)
            slot_list, offsets = groups.setdefault(chunk, ([], []))
            slot_list.append(slot)
            offsets.append(offset)
        return [
            (chunk, torch.tensor(slot_list, device=self.device), torch.tensor(offsets, device=self.device))
            for chunk, (slot_list, offsets) in groups.items()
        ]

    def write_decode(
        self,
        layer: int,
        where: list[tuple[int, torch.Tensor, torch.Tensor]],
        k: torch.Tensor,
        v: torch.Tensor,
    ) -> None:
        """k, v [slots, kv_heads, head_dim]: each slot's new token, at the positions `where` names."""
        kv = torch.stack((k, v), dim=1)  # [slots, 2, kv_heads, head_dim]
        single = len(where) == 1
        for chunk, slot_t, offset_t in where:
            # [2, slots, kv_heads, C, D] viewed as [slots, C, 2, kv_heads, D]: one (slot, offset) pair each.
            view = self.chunks[layer][chunk].permute(1, 3, 0, 2, 4)
            view.index_put_((slot_t, offset_t), kv if single else kv.index_select(0, slot_t))

    def decode_mask(self, lengths: list[int]) -> torch.Tensor:
        """Additive mask [slots, 1, 1, capacity]: positions past each slot's new token are -inf."""
        positions = torch.arange(self.capacity_tokens, device=self.device)
        limit = torch.tensor(lengths, device=self.device).unsqueeze(1)
        return torch.where(positions <= limit, 0.0, float("-inf")).view(len(lengths), 1, 1, -1)


def release() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()

"""Request rows: which pool slot holds token j of request row r."""

from __future__ import annotations

import torch

from kvtier.tiers.allocator import TokenAllocator
from kvtier.tiers.indices import check_indices, check_size


class ReqToTokenPool:
    """Dense int32 `[size+1, max_context_len]`; row 0 is padding and never handed out."""

    def __init__(
        self, size: int, max_context_len: int, device: str | torch.device = "cpu"
    ) -> None:
        check_size("size", size)
        self.max_context_len = check_size("max_context_len", max_context_len)
        self.req_to_token = torch.zeros(
            size + 1, max_context_len, dtype=torch.int32, device=device
        )
        self._rows = TokenAllocator(size)

    def available_size(self) -> int:
        return self._rows.available_size()

    def alloc(self, n: int) -> torch.Tensor | None:
        return self._rows.alloc(n)

    def free(self, rows: torch.Tensor) -> None:
        self._rows.free(rows)

    def write(self, row: int, start: int, values: torch.Tensor) -> None:
        """Row `row`, columns [start, start+len(values)) := values (pool slot indices)."""
        check_indices("values", values)
        end = start + values.numel()
        if not 0 <= start <= end <= self.max_context_len:
            raise ValueError(
                f"write: columns [{start}, {end}) outside [0, max_context_len={self.max_context_len})"
            )
        self.req_to_token[row, start:end] = values.to(torch.int32)

    def read(self, row: int, length: int) -> torch.Tensor:
        """The first `length` slot indices of `row` as int64."""
        return self.req_to_token[row, :length].to(torch.int64)

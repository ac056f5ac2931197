// SPDX-License-Identifier: MIT OR Apache-2.0
// Token embedding: rows of a table looked up by integer ids (torch.nn.Embedding, mlx.nn.Embedding).
#pragma once

#include "../ops/index.hpp"
#include "helpers.hpp"

namespace nn {

/// ids: (...) int32/int64, table: (vocab, C) -> (..., C).
/// The gradient scatter-adds into the table's rows, so a repeated id accumulates (the
/// gather_rows primitive); an id outside [0, vocab) raises on every run, replays included.
template <class B>
GVar embedding(GTape<B>& tp, GVar ids, GVar table) {
  if (tp.dtype(table) != DType::bf16) detail::layer_float(tp, table, "embedding", "table");
  DType it = tp.dtype(ids);
  if (it != DType::i32 && it != DType::i64)
    detail::fail("embedding", "ids must be int32 or int64, got ", detail::desc(tp, ids));
  if (tp.shape(table).rank() != 2)
    detail::fail("embedding", "table must be (vocab, C), got ", tp.shape(table).str(), " (ids ", tp.shape(ids).str(), ")");
  return gather_rows(tp, table, ids);
}

}  // namespace nn

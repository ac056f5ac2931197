// SPDX-License-Identifier: MIT OR Apache-2.0
// layers/embedding.hpp: lookup, repeated ids accumulating into the table's gradient.
#include "layer_case.hpp"

namespace layers_embedding {  // one unity source with the other layers files: its names stay its own

using namespace nn;

TEST_CASE("embedding matches torch.nn.functional.embedding (repeated ids accumulate)") {
  test::check_layer_case("embedding/repeats", [](auto& tp, auto& v, auto&) { return embedding(tp, v["ids"], v["table"]); });
}

TEST_CASE("embedding: shapes, finite differences, int32 ids") {
  Tensor table = test::random_tensor({7, 3}, DType::f64, 91);
  Tensor ids = Tensor::from<std::int32_t>({2, 4}, {1, 1, 6, 0, 3, 1, 6, 2});
  GTape<cpu> tp;
  GVar y = embedding(tp, tp.constant(ids), tp.constant(table));
  CHECK(tp.shape(y) == Shape{2, 4, 3});
  CHECK(tp.value(y).item(3 * 3 + 1) == table.item(0 * 3 + 1));
  double e = test::layer_gradcheck("embedding", {table}, [&](GTape<cpu>& t, const std::vector<GVar>& v) {
    return embedding(t, t.constant(ids), v[0]);
  });
  CHECK(e <= 1e-7);
}

TEST_CASE("embedding: errors name the layer") {
  GTape<cpu> tp;
  GVar table = tp.constant(Tensor::zeros({5, 3}));
  GVar fids = tp.constant(Tensor::zeros({2}));
  GVar ids = tp.constant(Tensor::from<std::int64_t>({2}, {1, 5}));
  test::check_error([&] { embedding(tp, fids, table); }, {"[embedding]", "float32", "(2)"});
  test::check_error([&] { embedding(tp, ids, tp.constant(Tensor::zeros({5}))); }, {"[embedding]", "(5)"});
  test::check_error([&] { embedding(tp, ids, table); }, {"id 5", "5 rows"});
}

}  // namespace layers_embedding

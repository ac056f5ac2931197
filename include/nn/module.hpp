// SPDX-License-Identifier: MIT OR Apache-2.0
// Modules: a model is a plain struct whose fields NN_MODULE reflects into a parameter tree named
// as MLX and PyTorch name it ("layers.0.self_attn.q_proj.weight"), with the tree algorithms
// (parameters, freeze, train, map_modules, to, summary) and value_and_grad over it.
#pragma once

#include <filesystem>
#include <functional>
#include <iomanip>
#include <optional>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include "statics.hpp"
#include "tape.hpp"

namespace nn {

/// The host backend (backend/cpu.hpp), declared here only as value_and_grad's default: the
/// module layer sits above the tape and names no backend's kernels.
struct cpu;

/// A trainable tensor of a module. `trainable` is what freeze()/unfreeze() flip.
struct Param {
  Tensor value;
  bool trainable = true;

  Param() = default;
  Param(Tensor t, bool train = true) : value(std::move(t)), trainable(train) {}  // NOLINT: implicit by design
  const Shape& shape() const { return value.shape(); }
  DType dtype() const { return value.dtype(); }
};

/// A tensor saved and loaded with the module but never trained (running statistics, packed
/// quantized weights).
struct Buffer {
  Tensor value;

  Buffer() = default;
  Buffer(Tensor t) : value(std::move(t)) {}  // NOLINT: implicit by design
  const Shape& shape() const { return value.shape(); }
  DType dtype() const { return value.dtype(); }
};

/// Binds a module's Param on the tape (a gradient when trainable) or a Buffer (a constant).
template <class B>
GVar param(GTape<B>& tp, const Param& p) {
  return tp.param(p.value, p.trainable);
}
template <class B>
GVar param(GTape<B>& tp, const Buffer& b) {
  return tp.constant(b.value);
}

namespace detail {

/// A field listed as NN_RENAME(member, "name"): reflected under `name`.
template <class T>
struct Renamed {
  const char* name;
  T& ref;
};
template <class T>
Renamed<T> renamed(T& ref, const char* name) {
  return {name, ref};
}

template <class T>
struct is_vector : std::false_type {};
template <class T, class A>
struct is_vector<std::vector<T, A>> : std::true_type {};
template <class T>
struct is_optional : std::false_type {};
template <class T>
struct is_optional<std::optional<T>> : std::true_type {};
template <class T>
struct is_variant : std::false_type {};
template <class... T>
struct is_variant<std::variant<T...>> : std::true_type {};
template <class T>
struct is_renamed : std::false_type {};
template <class T>
struct is_renamed<Renamed<T>> : std::true_type {};

template <class T>
concept ModuleType = requires { T::nn_type_name; };

/// Whether a field type can be reflected: Param, Buffer, a module, or a vector / optional /
/// variant of those. Checked once per field when the struct is defined.
template <class T>
constexpr bool field_ok() {
  using U = std::remove_cvref_t<T>;
  if constexpr (is_renamed<U>::value) return field_ok<decltype(std::declval<U>().ref)>();
  else if constexpr (is_statics<U>::value || is_unchecked<U>::value) return true;
  else if constexpr (std::is_same_v<U, Param> || std::is_same_v<U, Buffer>) return true;
  else if constexpr (ModuleType<U>) return true;
  else if constexpr (is_vector<U>::value || is_optional<U>::value) return field_ok<typename U::value_type>();
  else if constexpr (is_variant<U>::value)
    return []<class... A>(std::variant<A...>*) { return (field_ok<A>() && ...); }(static_cast<U*>(nullptr));
  else return false;
}

/// Whether every member of an NN_STATIC(...) can be configuration (true for other items).
template <class T>
constexpr bool statics_ok() {
  if constexpr (is_statics<T>::value)
    return []<class... A>(Statics<A...>*) { return (static_ok<A>() && ...); }(static_cast<T*>(nullptr));
  else return true;
}

/// How many data members one NN_MODULE item stands for.
template <class T>
constexpr std::size_t item_members() {
  using U = std::remove_cvref_t<T>;
  if constexpr (is_statics<U>::value || is_unchecked<U>::value) return U::count;
  else return 1;
}

template <class V, class T>
void visit_field(V& v, const char* name, T& field) {
  v(name, field);
}
template <class V, class T>
void visit_field(V& v, const char*, Renamed<T> r) {
  v(r.name, r.ref);
}
template <class V, class... T>
void visit_field(V&, const char*, Statics<T...>) {}  // configuration: not a tree node
template <class V, class... T>
void visit_field(V&, const char*, Unchecked<T...>) {}

template <class T>
void visit_static(StaticSink&, const T&) {}
template <class... T>
void visit_static(StaticSink& s, const Statics<T...>& st) {
  st.visit(s);
}

/// Brace-initialisation probing (as Boost.PFR counts an aggregate's fields): converts to any
/// member type, so T{AnyField{} x n} compiles exactly when the aggregate T has at least n
/// members.
struct AnyField {
  template <class T>
  operator T&() const&& noexcept;  // NOLINT: implicit by design; never defined (unevaluated)
};
template <class T, std::size_t... I>
constexpr bool takes_fields(std::index_sequence<I...>) {
  return requires { T{((void)I, AnyField{})...}; };
}
/// For an aggregate module: true when it has more data members than NN_MODULE accounts for
/// (`listed` items' members plus the training flag NN_MODULE adds).
template <class T, std::size_t listed>
constexpr bool has_unlisted_members() {
  if constexpr (!std::is_aggregate_v<T>) return false;
  else return takes_fields<T>(std::make_index_sequence<listed + 2>{});
}

inline std::string join_path(const std::string& prefix, const std::string& name) {
  return prefix.empty() ? name : prefix + "." + name;
}

/// Walks the tree depth first in declaration order, calling f.param(path, Param&),
/// f.buffer(path, Buffer&) and f.module(path, Module&) (pre-order). Vectors add an index
/// segment; optionals and variants are transparent.
template <class X, class F>
void walk(X& x, const std::string& path, F& f) {
  using U = std::remove_cvref_t<X>;
  if constexpr (std::is_same_v<U, Param>) {
    f.param(path, x);
  } else if constexpr (std::is_same_v<U, Buffer>) {
    f.buffer(path, x);
  } else if constexpr (ModuleType<U>) {
    f.module(path, x);
    auto visitor = [&](const char* name, auto& field) { walk(field, join_path(path, name), f); };
    x.nn_visit(visitor);
  } else if constexpr (is_vector<U>::value) {
    for (std::size_t i = 0; i < x.size(); ++i) walk(x[i], join_path(path, std::to_string(i)), f);
  } else if constexpr (is_optional<U>::value) {
    if (x) walk(*x, path, f);
  } else if constexpr (is_variant<U>::value) {
    std::visit([&](auto& alt) { walk(alt, path, f); }, x);
  } else {
    static_assert(sizeof(U) == 0, "nn: this field type cannot be part of a module tree");
  }
}

/// A walker from lambdas; the ones not given do nothing.
template <class P, class Bf, class M>
struct Walker {
  P on_param;
  Bf on_buffer;
  M on_module;
  template <class T>
  void param(const std::string& p, T& x) { on_param(p, x); }
  template <class T>
  void buffer(const std::string& p, T& x) { on_buffer(p, x); }
  template <class T>
  void module(const std::string& p, T& x) { on_module(p, x); }
};
inline constexpr auto ignore = [](const std::string&, auto&) {};
template <class X, class P = decltype(ignore), class Bf = decltype(ignore), class M = decltype(ignore)>
void for_each(X& x, P on_param, Bf on_buffer = ignore, M on_module = ignore) {
  Walker<P, Bf, M> w{on_param, on_buffer, on_module};
  walk(x, std::string(), w);
}

template <class X>
std::vector<std::pair<std::string, Tensor>> tree_parameters(const X& m, bool trainable_only) {
  std::vector<std::pair<std::string, Tensor>> out;
  for_each(
      m, [&](const std::string& p, const Param& x) { if (!trainable_only || x.trainable) out.emplace_back(p, x.value); },
      [&](const std::string& p, const Buffer& x) { if (!trainable_only) out.emplace_back(p, x.value); });
  return out;
}

template <class X>
std::int64_t tree_count(const X& m, bool trainable_only) {
  std::int64_t n = 0;
  for_each(
      m, [&](const std::string&, const Param& x) { if (!trainable_only || x.trainable) n += x.value.numel(); },
      [&](const std::string&, const Buffer& x) { if (!trainable_only) n += x.value.numel(); });
  return n;
}

template <class X, class Pred>
int tree_set_trainable(X& m, Pred pred, bool trainable) {
  int changed = 0;
  for_each(m, [&](const std::string& p, Param& x) {
    if (x.trainable != trainable && pred(p)) {
      x.trainable = trainable;
      ++changed;
    }
  });
  return changed;
}

/// "1,234,567"
inline std::string with_commas(std::int64_t v) {
  std::string s = std::to_string(v);
  for (int i = static_cast<int>(s.size()) - 3; i > (v < 0 ? 1 : 0); i -= 3) s.insert(s.begin() + i, ',');
  return s;
}

template <class X>
std::string counts(const X& m) {
  return "(" + with_commas(tree_count(m, false)) + " params, " + with_commas(tree_count(m, true)) + " trainable)";
}

template <class X>
std::string tree_summary(const X& m) {
  struct Row {
    std::string path, shape, dtype, trainable, bytes;
  };
  std::vector<Row> rows{{"path", "shape", "dtype", "trainable", "bytes"}};
  std::int64_t total = 0;
  auto add = [&](const std::string& p, const Tensor& t, const char* tr) {
    rows.push_back({p, t.shape().str(), dtype_name(t.dtype()), tr, with_commas(static_cast<std::int64_t>(t.nbytes()))});
    total += static_cast<std::int64_t>(t.nbytes());
  };
  for_each(
      m, [&](const std::string& p, const Param& x) { add(p, x.value, x.trainable ? "yes" : "no"); },
      [&](const std::string& p, const Buffer& x) { add(p, x.value, "buffer"); });
  std::array<std::size_t, 5> w{};
  for (const auto& r : rows) {
    w[0] = std::max(w[0], r.path.size());
    w[1] = std::max(w[1], r.shape.size());
    w[2] = std::max(w[2], r.dtype.size());
    w[3] = std::max(w[3], r.trainable.size());
    w[4] = std::max(w[4], r.bytes.size());
  }
  std::ostringstream os;
  for (const auto& r : rows)
    os << std::left << std::setw(static_cast<int>(w[0])) << r.path << "  " << std::setw(static_cast<int>(w[1]))
       << r.shape << "  " << std::setw(static_cast<int>(w[2])) << r.dtype << "  " << std::setw(static_cast<int>(w[3]))
       << r.trainable << "  " << std::right << std::setw(static_cast<int>(w[4])) << r.bytes << "\n";
  os << counts(m) << ", " << with_commas(total) << " bytes\n";
  return os.str();
}

/// Prints one line per submodule for tree_display, named relative to its parent module
/// ("layers.0" under a model holding a vector of layers) and indented by nesting.
struct DisplayWalker {
  std::ostringstream& os;
  std::vector<std::string> parents;  // paths of the enclosing modules
  void param(const std::string&, const Param&) {}
  void buffer(const std::string&, const Buffer&) {}
  template <class M>
  void module(const std::string& path, const M& mod) {
    if (path.empty()) {
      parents = {""};
      return;
    }
    auto inside = [&](const std::string& parent) {
      return parent.empty() || (path.size() > parent.size() && path.compare(0, parent.size(), parent) == 0 &&
                                path[parent.size()] == '.');
    };
    while (parents.size() > 1 && !inside(parents.back())) parents.pop_back();
    const std::string& parent = parents.back();
    const std::string name = parent.empty() ? path : path.substr(parent.size() + 1);
    os << std::string(2 * parents.size(), ' ') << name << ": " << M::nn_type_name << " " << counts(mod) << "\n";
    parents.push_back(path);
  }
};

/// One line per module, indented by depth: "name: Type (n params, m trainable)".
template <class X>
std::string tree_display(const X& m) {
  std::ostringstream os;
  os << X::nn_type_name << " " << counts(m) << "\n";
  DisplayWalker d{os, {}};
  walk(m, std::string(), d);
  return os.str();
}

template <class X>
void tree_train(X& m, bool mode) {
  for_each(m, ignore, ignore, [&](const std::string&, auto& mod) { mod.nn_training_ = mode; });
}

template <class X>
void tree_to(X& m, DType dt) {
  if (!is_floating(dt)) fail("to", "a module converts to a floating dtype, not ", dtype_name(dt));
  auto conv = [&](const std::string&, auto& x) {
    if (is_floating(x.value.dtype()) && x.value.dtype() != dt) x.value = x.value.to(dt);
  };
  for_each(m, conv, conv);
}

/// Moves every Param and Buffer to `dev` (a no-op for those already there). Tensors are
/// replaced, not written in place: a tape recorded before the move must be recorded again.
template <class X>
void tree_to_device(X& m, Device dev) {
  auto move = [&](const std::string&, auto& x) {
    if (x.value.defined() && x.value.device() != dev) x.value = x.value.to(dev);
  };
  for_each(m, move, move);
}

/// The structure of a module tree as one hash: the tree's shape (field names, vector lengths,
/// which optionals are engaged, which variant alternatives hold), each Param's and Buffer's
/// shape, dtype, device, address and storage identity, the frozen set, every module's train/eval flag and
/// every NN_STATIC value. A compiled step compares it on every call; nothing here allocates.
struct StructureHasher {
  HashSink sink;

  void tensor(const Tensor& t) {
    sink.fnv.pod(&t);  // a tape binds the Tensor object by address (a moved module records again)
    sink.fnv.pod(t.raw());
    sink.fnv.pod(t.dtype());
    sink.fnv.pod(t.device());
    sink.fnv.pod(t.rank());
    for (std::int64_t d : t.shape()) sink.fnv.pod(d);
  }
  template <class X>
  void node(const X& x) {
    using U = std::remove_cvref_t<X>;
    if constexpr (std::is_same_v<U, Param>) {
      tensor(x.value);
      sink.fnv.pod(x.trainable);
    } else if constexpr (std::is_same_v<U, Buffer>) {
      tensor(x.value);
    } else if constexpr (ModuleType<U>) {
      sink.fnv.pod(U::nn_type_name);  // the literal's address: unique per type within a process
      sink.fnv.pod(x.nn_training_);
      x.nn_visit([&](const char* name, const auto& field) {
        sink.fnv.pod(name);
        node(field);
      });
      x.nn_visit_static(sink);
    } else if constexpr (is_vector<U>::value) {
      sink.fnv.pod(x.size());
      for (const auto& e : x) node(e);
    } else if constexpr (is_optional<U>::value) {
      sink.fnv.pod(x.has_value());
      if (x) node(*x);
    } else if constexpr (is_variant<U>::value) {
      sink.fnv.pod(x.index());
      std::visit([&](const auto& alt) { node(alt); }, x);
    }
  }
};

template <class X>
std::uint64_t structure_hash(const X& m) {
  StructureHasher h;
  h.node(m);
  return h.sink.fnv.h;
}

/// map_modules: calls f(path, T&) on every submodule of type T whose path satisfies pred. When
/// the T sits in a std::variant field and f returns a value (say a LoraLinear built from the
/// Linear), the variant is assigned that value: how a layer is replaced in place.
template <class T, class Pred, class F>
struct ModuleMapper {
  Pred& pred;
  F& f;
  int count = 0;

  template <class X>
  void walk_node(X& x, const std::string& path) {
    using U = std::remove_cvref_t<X>;
    if constexpr (std::is_same_v<U, T>) {
      if (pred(path)) {
        ++count;
        using R = decltype(f(path, x));
        if constexpr (std::is_void_v<R>) f(path, x);
        else if constexpr (std::is_assignable_v<U&, R>) x = f(path, x);
        else fail("map_modules", "the module at '", path, "' is not held in a std::variant that can take the replacement");
      }
      recurse(x, path);
    } else if constexpr (is_variant<U>::value) {
      std::visit(
          [&](auto& alt) {
            using A = std::remove_cvref_t<decltype(alt)>;
            if constexpr (std::is_same_v<A, T>) {
              if (pred(path)) {
                ++count;
                using R = decltype(f(path, alt));
                if constexpr (std::is_void_v<R>) {
                  f(path, alt);
                } else if constexpr (std::is_assignable_v<U&, R>) {
                  x = f(path, alt);  // replaces the alternative; alt is dangling from here on
                  return;
                } else {
                  fail("map_modules", "the module at '", path, "' is held in a std::variant that cannot take the replacement");
                }
              }
              recurse(alt, path);
            } else {
              walk_node(alt, path);
            }
          },
          x);
    } else if constexpr (is_vector<U>::value) {
      for (std::size_t i = 0; i < x.size(); ++i) walk_node(x[i], join_path(path, std::to_string(i)));
    } else if constexpr (is_optional<U>::value) {
      if (x) walk_node(*x, path);
    } else if constexpr (ModuleType<U>) {
      recurse(x, path);
    }
  }
  template <class X>
  void recurse(X& x, const std::string& path) {
    if constexpr (ModuleType<std::remove_cvref_t<X>>) {
      auto visitor = [&](const char* name, auto& field) { walk_node(field, join_path(path, name)); };
      x.nn_visit(visitor);
    }
  }
};

// Weight files (defined in io/weights.hpp, which nn.hpp includes): declared here so NN_MODULE's
// members can name them.
using NamedTensorList = std::vector<std::pair<std::string, Tensor>>;
template <class M>
void save_weights_impl(const M& m, const std::filesystem::path& path, bool trainable_only);
template <class M>
void load_weights_impl(M& m, const NamedTensorList& named, bool strict, const std::string& source);
template <class M>
void load_weights_file(M& m, const std::filesystem::path& path, bool strict);

}  // namespace detail

/// Gradients of a model's own type: runs f(tape, model) -> scalar loss GVar, back-propagates,
/// and returns {loss, grads} where grads is a copy of the model whose trainable Params hold their
/// gradients (zeros when the loss does not depend on them) and whose frozen Params are empty.
/// Frozen parameters are bound as constants, so they cost no gradient work.
template <class B = cpu, class M, class F>
std::pair<Tensor, M> value_and_grad(M& model, F&& f) {
  GTape<B> tp;
  GVar loss = f(tp, static_cast<const M&>(model));
  tp.backward(loss);
  M grads = model;
  std::vector<const Param*> src;
  std::vector<Param*> dst;
  detail::for_each(static_cast<const M&>(model), [&](const std::string&, const Param& p) { src.push_back(&p); });
  detail::for_each(grads, [&](const std::string&, Param& p) { dst.push_back(&p); });
  for (std::size_t i = 0; i < src.size(); ++i) {
    if (!src[i]->trainable || !is_floating(src[i]->value.dtype())) {
      dst[i]->value = Tensor();
      continue;
    }
    std::optional<GVar> v = tp.find_param(src[i]->value);
    if (v) {
      dst[i]->value = tp.grad(*v);
    } else {
      dst[i]->value = B::alloc(src[i]->value.shape(), src[i]->value.dtype());
      B::fill(dst[i]->value, 0.0);
    }
  }
  return {tp.value(loss), std::move(grads)};
}

/// How a model's frozen weights are stored. Precision::bf16 keeps every frozen matrix (Linear
/// weights, embedding tables, a LoRA base) in bfloat16, half the memory; products read them as
/// bf16 operands (activations rounded to bf16) with f32 accumulation, on AMX, AVX512_BF16 or the
/// f32 kernels, whichever measures fastest here (gemm::bf16_kernel, backend/gemm.hpp), and the
/// embedding lookup widens its rows. What
/// trains (trainable Params, the optimizer's state), vectors (norm gains, biases), Buffers and
/// every reduction stay float32. PyTorch's bf16 autocast makes the same choice for a product.
enum class Precision { f32, bf16 };

/// Precision::bf16: every frozen float32 Param of rank 2 is stored in bfloat16 (rounded to
/// nearest even). Precision::f32: every bfloat16 Param back in float32 (exact). Returns how many
/// were converted. The tensors are replaced, not written in place: a tape or compiled step
/// recorded before must be recorded again.
template <class X>
int set_precision(X& m, Precision p) {
  int n = 0;
  detail::for_each(m, [&](const std::string&, Param& prm) {
    Tensor& t = prm.value;
    if (!t.defined()) return;
    if (p == Precision::bf16 && !prm.trainable && t.rank() == 2 && t.dtype() == DType::f32) {
      t = t.to(DType::bf16);
      ++n;
    } else if (p == Precision::f32 && t.dtype() == DType::bf16) {
      t = t.to(DType::f32);
      ++n;
    }
  });
  return n;
}

}  // namespace nn

// Applies NN_DETAIL_VISIT_FIELD to each of up to 64 arguments.
#define NN_DETAIL_EXPAND(x) x
#define NN_DETAIL_FE_1(m, x) m(x)
#define NN_DETAIL_FE_2(m, x, ...) m(x) NN_DETAIL_EXPAND(NN_DETAIL_FE_1(m, __VA_ARGS__))
#define NN_DETAIL_FE_3(m, x, ...) m(x) NN_DETAIL_EXPAND(NN_DETAIL_FE_2(m, __VA_ARGS__))
#define NN_DETAIL_FE_4(m, x, ...) m(x) NN_DETAIL_EXPAND(NN_DETAIL_FE_3(m, __VA_ARGS__))
#define NN_DETAIL_FE_5(m, x, ...) m(x) NN_DETAIL_EXPAND(NN_DETAIL_FE_4(m, __VA_ARGS__))
#define NN_DETAIL_FE_6(m, x, ...) m(x) NN_DETAIL_EXPAND(NN_DETAIL_FE_5(m, __VA_ARGS__))
#define NN_DETAIL_FE_7(m, x, ...) m(x) NN_DETAIL_EXPAND(NN_DETAIL_FE_6(m, __VA_ARGS__))
#define NN_DETAIL_FE_8(m, x, ...) m(x) NN_DETAIL_EXPAND(NN_DETAIL_FE_7(m, __VA_ARGS__))
#define NN_DETAIL_FE_9(m, x, ...) m(x) NN_DETAIL_EXPAND(NN_DETAIL_FE_8(m, __VA_ARGS__))
#define NN_DETAIL_FE_10(m, x, ...) m(x) NN_DETAIL_EXPAND(NN_DETAIL_FE_9(m, __VA_ARGS__))
#define NN_DETAIL_FE_11(m, x, ...) m(x) NN_DETAIL_EXPAND(NN_DETAIL_FE_10(m, __VA_ARGS__))
#define NN_DETAIL_FE_12(m, x, ...) m(x) NN_DETAIL_EXPAND(NN_DETAIL_FE_11(m, __VA_ARGS__))
#define NN_DETAIL_FE_13(m, x, ...) m(x) NN_DETAIL_EXPAND(NN_DETAIL_FE_12(m, __VA_ARGS__))
#define NN_DETAIL_FE_14(m, x, ...) m(x) NN_DETAIL_EXPAND(NN_DETAIL_FE_13(m, __VA_ARGS__))
#define NN_DETAIL_FE_15(m, x, ...) m(x) NN_DETAIL_EXPAND(NN_DETAIL_FE_14(m, __VA_ARGS__))
#define NN_DETAIL_FE_16(m, x, ...) m(x) NN_DETAIL_EXPAND(NN_DETAIL_FE_15(m, __VA_ARGS__))
#define NN_DETAIL_FE_17(m, x, ...) m(x) NN_DETAIL_EXPAND(NN_DETAIL_FE_16(m, __VA_ARGS__))
#define NN_DETAIL_FE_18(m, x, ...) m(x) NN_DETAIL_EXPAND(NN_DETAIL_FE_17(m, __VA_ARGS__))
#define NN_DETAIL_FE_19(m, x, ...) m(x) NN_DETAIL_EXPAND(NN_DETAIL_FE_18(m, __VA_ARGS__))
#define NN_DETAIL_FE_20(m, x, ...) m(x) NN_DETAIL_EXPAND(NN_DETAIL_FE_19(m, __VA_ARGS__))
#define NN_DETAIL_FE_21(m, x, ...) m(x) NN_DETAIL_EXPAND(NN_DETAIL_FE_20(m, __VA_ARGS__))
#define NN_DETAIL_FE_22(m, x, ...) m(x) NN_DETAIL_EXPAND(NN_DETAIL_FE_21(m, __VA_ARGS__))
#define NN_DETAIL_FE_23(m, x, ...) m(x) NN_DETAIL_EXPAND(NN_DETAIL_FE_22(m, __VA_ARGS__))
#define NN_DETAIL_FE_24(m, x, ...) m(x) NN_DETAIL_EXPAND(NN_DETAIL_FE_23(m, __VA_ARGS__))
#define NN_DETAIL_FE_25(m, x, ...) m(x) NN_DETAIL_EXPAND(NN_DETAIL_FE_24(m, __VA_ARGS__))
#define NN_DETAIL_FE_26(m, x, ...) m(x) NN_DETAIL_EXPAND(NN_DETAIL_FE_25(m, __VA_ARGS__))
#define NN_DETAIL_FE_27(m, x, ...) m(x) NN_DETAIL_EXPAND(NN_DETAIL_FE_26(m, __VA_ARGS__))
#define NN_DETAIL_FE_28(m, x, ...) m(x) NN_DETAIL_EXPAND(NN_DETAIL_FE_27(m, __VA_ARGS__))
#define NN_DETAIL_FE_29(m, x, ...) m(x) NN_DETAIL_EXPAND(NN_DETAIL_FE_28(m, __VA_ARGS__))
#define NN_DETAIL_FE_30(m, x, ...) m(x) NN_DETAIL_EXPAND(NN_DETAIL_FE_29(m, __VA_ARGS__))
#define NN_DETAIL_FE_31(m, x, ...) m(x) NN_DETAIL_EXPAND(NN_DETAIL_FE_30(m, __VA_ARGS__))
#define NN_DETAIL_FE_32(m, x, ...) m(x) NN_DETAIL_EXPAND(NN_DETAIL_FE_31(m, __VA_ARGS__))
#define NN_DETAIL_FE_33(m, x, ...) m(x) NN_DETAIL_EXPAND(NN_DETAIL_FE_32(m, __VA_ARGS__))
#define NN_DETAIL_FE_34(m, x, ...) m(x) NN_DETAIL_EXPAND(NN_DETAIL_FE_33(m, __VA_ARGS__))
#define NN_DETAIL_FE_35(m, x, ...) m(x) NN_DETAIL_EXPAND(NN_DETAIL_FE_34(m, __VA_ARGS__))
#define NN_DETAIL_FE_36(m, x, ...) m(x) NN_DETAIL_EXPAND(NN_DETAIL_FE_35(m, __VA_ARGS__))
#define NN_DETAIL_FE_37(m, x, ...) m(x) NN_DETAIL_EXPAND(NN_DETAIL_FE_36(m, __VA_ARGS__))
#define NN_DETAIL_FE_38(m, x, ...) m(x) NN_DETAIL_EXPAND(NN_DETAIL_FE_37(m, __VA_ARGS__))
#define NN_DETAIL_FE_39(m, x, ...) m(x) NN_DETAIL_EXPAND(NN_DETAIL_FE_38(m, __VA_ARGS__))
#define NN_DETAIL_FE_40(m, x, ...) m(x) NN_DETAIL_EXPAND(NN_DETAIL_FE_39(m, __VA_ARGS__))
#define NN_DETAIL_FE_41(m, x, ...) m(x) NN_DETAIL_EXPAND(NN_DETAIL_FE_40(m, __VA_ARGS__))
#define NN_DETAIL_FE_42(m, x, ...) m(x) NN_DETAIL_EXPAND(NN_DETAIL_FE_41(m, __VA_ARGS__))
#define NN_DETAIL_FE_43(m, x, ...) m(x) NN_DETAIL_EXPAND(NN_DETAIL_FE_42(m, __VA_ARGS__))
#define NN_DETAIL_FE_44(m, x, ...) m(x) NN_DETAIL_EXPAND(NN_DETAIL_FE_43(m, __VA_ARGS__))
#define NN_DETAIL_FE_45(m, x, ...) m(x) NN_DETAIL_EXPAND(NN_DETAIL_FE_44(m, __VA_ARGS__))
#define NN_DETAIL_FE_46(m, x, ...) m(x) NN_DETAIL_EXPAND(NN_DETAIL_FE_45(m, __VA_ARGS__))
#define NN_DETAIL_FE_47(m, x, ...) m(x) NN_DETAIL_EXPAND(NN_DETAIL_FE_46(m, __VA_ARGS__))
#define NN_DETAIL_FE_48(m, x, ...) m(x) NN_DETAIL_EXPAND(NN_DETAIL_FE_47(m, __VA_ARGS__))
#define NN_DETAIL_FE_49(m, x, ...) m(x) NN_DETAIL_EXPAND(NN_DETAIL_FE_48(m, __VA_ARGS__))
#define NN_DETAIL_FE_50(m, x, ...) m(x) NN_DETAIL_EXPAND(NN_DETAIL_FE_49(m, __VA_ARGS__))
#define NN_DETAIL_FE_51(m, x, ...) m(x) NN_DETAIL_EXPAND(NN_DETAIL_FE_50(m, __VA_ARGS__))
#define NN_DETAIL_FE_52(m, x, ...) m(x) NN_DETAIL_EXPAND(NN_DETAIL_FE_51(m, __VA_ARGS__))
#define NN_DETAIL_FE_53(m, x, ...) m(x) NN_DETAIL_EXPAND(NN_DETAIL_FE_52(m, __VA_ARGS__))
#define NN_DETAIL_FE_54(m, x, ...) m(x) NN_DETAIL_EXPAND(NN_DETAIL_FE_53(m, __VA_ARGS__))
#define NN_DETAIL_FE_55(m, x, ...) m(x) NN_DETAIL_EXPAND(NN_DETAIL_FE_54(m, __VA_ARGS__))
#define NN_DETAIL_FE_56(m, x, ...) m(x) NN_DETAIL_EXPAND(NN_DETAIL_FE_55(m, __VA_ARGS__))
#define NN_DETAIL_FE_57(m, x, ...) m(x) NN_DETAIL_EXPAND(NN_DETAIL_FE_56(m, __VA_ARGS__))
#define NN_DETAIL_FE_58(m, x, ...) m(x) NN_DETAIL_EXPAND(NN_DETAIL_FE_57(m, __VA_ARGS__))
#define NN_DETAIL_FE_59(m, x, ...) m(x) NN_DETAIL_EXPAND(NN_DETAIL_FE_58(m, __VA_ARGS__))
#define NN_DETAIL_FE_60(m, x, ...) m(x) NN_DETAIL_EXPAND(NN_DETAIL_FE_59(m, __VA_ARGS__))
#define NN_DETAIL_FE_61(m, x, ...) m(x) NN_DETAIL_EXPAND(NN_DETAIL_FE_60(m, __VA_ARGS__))
#define NN_DETAIL_FE_62(m, x, ...) m(x) NN_DETAIL_EXPAND(NN_DETAIL_FE_61(m, __VA_ARGS__))
#define NN_DETAIL_FE_63(m, x, ...) m(x) NN_DETAIL_EXPAND(NN_DETAIL_FE_62(m, __VA_ARGS__))
#define NN_DETAIL_FE_64(m, x, ...) m(x) NN_DETAIL_EXPAND(NN_DETAIL_FE_63(m, __VA_ARGS__))
#define NN_DETAIL_FE_PICK(_1, _2, _3, _4, _5, _6, _7, _8, _9, _10, _11, _12, _13, _14, _15, _16, _17, _18, _19, _20, _21, _22, _23, _24, _25, _26, _27, _28, _29, _30, _31, _32, _33, _34, _35, _36, _37, _38, _39, _40, _41, _42, _43, _44, _45, _46, _47, _48, _49, _50, _51, _52, _53, _54, _55, _56, _57, _58, _59, _60, _61, _62, _63, _64, NAME, ...) NAME
#define NN_DETAIL_FOR_EACH(m, ...) NN_DETAIL_EXPAND(NN_DETAIL_FE_PICK(__VA_ARGS__, NN_DETAIL_FE_64, NN_DETAIL_FE_63, NN_DETAIL_FE_62, NN_DETAIL_FE_61, NN_DETAIL_FE_60, NN_DETAIL_FE_59, NN_DETAIL_FE_58, NN_DETAIL_FE_57, NN_DETAIL_FE_56, NN_DETAIL_FE_55, NN_DETAIL_FE_54, NN_DETAIL_FE_53, NN_DETAIL_FE_52, NN_DETAIL_FE_51, NN_DETAIL_FE_50, NN_DETAIL_FE_49, NN_DETAIL_FE_48, NN_DETAIL_FE_47, NN_DETAIL_FE_46, NN_DETAIL_FE_45, NN_DETAIL_FE_44, NN_DETAIL_FE_43, NN_DETAIL_FE_42, NN_DETAIL_FE_41, NN_DETAIL_FE_40, NN_DETAIL_FE_39, NN_DETAIL_FE_38, NN_DETAIL_FE_37, NN_DETAIL_FE_36, NN_DETAIL_FE_35, NN_DETAIL_FE_34, NN_DETAIL_FE_33, NN_DETAIL_FE_32, NN_DETAIL_FE_31, NN_DETAIL_FE_30, NN_DETAIL_FE_29, NN_DETAIL_FE_28, NN_DETAIL_FE_27, NN_DETAIL_FE_26, NN_DETAIL_FE_25, NN_DETAIL_FE_24, NN_DETAIL_FE_23, NN_DETAIL_FE_22, NN_DETAIL_FE_21, NN_DETAIL_FE_20, NN_DETAIL_FE_19, NN_DETAIL_FE_18, NN_DETAIL_FE_17, NN_DETAIL_FE_16, NN_DETAIL_FE_15, NN_DETAIL_FE_14, NN_DETAIL_FE_13, NN_DETAIL_FE_12, NN_DETAIL_FE_11, NN_DETAIL_FE_10, NN_DETAIL_FE_9, NN_DETAIL_FE_8, NN_DETAIL_FE_7, NN_DETAIL_FE_6, NN_DETAIL_FE_5, NN_DETAIL_FE_4, NN_DETAIL_FE_3, NN_DETAIL_FE_2, NN_DETAIL_FE_1)(m, __VA_ARGS__))

/// A field reflected under another name: NN_MODULE(Attention, q_proj, NN_RENAME(qn, "q_norm")).
#define NN_RENAME(member, name) ::nn::detail::renamed(member, name)

#define NN_DETAIL_VISIT_FIELD(f) ::nn::detail::visit_field(nn_v, #f, f);
#define NN_DETAIL_VISIT_STATIC(f) ::nn::detail::visit_static(nn_s, f);
#define NN_DETAIL_COUNT_FIELD(f) +::nn::detail::item_members<decltype(f)>()
#define NN_DETAIL_CHECK_FIELD(f)                                                                    \
  static_assert(::nn::detail::field_ok<decltype(f)>(),                                              \
                "NN_MODULE: field '" #f "' must be an nn::Param, an nn::Buffer, a module, or a "    \
                "std::vector / std::optional / std::variant of those (a bare nn::Tensor needs a "   \
                "role: nn::Param or nn::Buffer; configuration goes in NN_STATIC(...), a cache in "  \
                "NN_UNCHECKED(...))");                                                              \
  static_assert(::nn::detail::statics_ok<decltype(f)>(),                                            \
                "NN_MODULE: every member of " #f " must be a number, a flag, an enum or a std::string");

/// Reflects a module's fields (none, or up to 64 items), in declaration order, and gives it the
/// module API as members: parameters(), trainable_parameters(), num_params(), num_trainable(),
/// summary(), display(), freeze(pred), unfreeze(pred), train(bool), training(),
/// map_modules<T>(pred, f), to(dtype), save_weights(path), save_trainable(path),
/// load_weights(path or tensors), load_weights_partial(path or tensors). Put it last in the
/// struct: it adds one data member (the training flag), and last keeps aggregate initialisation
/// of the fields as written.
///
/// Every data member has a role: a field (a module, Param, Buffer, or a vector / optional /
/// variant of those), configuration in NN_STATIC(a_, b_) (hashed into the structure a compiled
/// step checks, so a change records the step again), or NN_UNCHECKED(c_) (a cache or
/// bookkeeping a recorded step may bake in). For an aggregate (public members, no constructors)
/// a member with no role is a compile error, found by brace-initialisation probing; for a class
/// with private members or constructors C++ cannot count the members, so the list is the
/// author's word (a base class's members are not counted either).
#define NN_MODULE(Type, ...)                                                                              \
  static constexpr const char* nn_type_name = #Type;                                                      \
  bool nn_training_ = true;                                                                               \
  template <class NnV>                                                                                    \
  void nn_visit([[maybe_unused]] NnV&& nn_v) {                                                            \
    __VA_OPT__(NN_DETAIL_FOR_EACH(NN_DETAIL_VISIT_FIELD, __VA_ARGS__))                                    \
  }                                                                                                       \
  template <class NnV>                                                                                    \
  void nn_visit([[maybe_unused]] NnV&& nn_v) const {                                                      \
    __VA_OPT__(NN_DETAIL_FOR_EACH(NN_DETAIL_VISIT_FIELD, __VA_ARGS__))                                    \
  }                                                                                                       \
  /** Every NN_STATIC value, as (name, value). */                                                       \
  void nn_visit_static([[maybe_unused]] ::nn::StaticSink& nn_s) const {                                   \
    __VA_OPT__(NN_DETAIL_FOR_EACH(NN_DETAIL_VISIT_STATIC, __VA_ARGS__))                                   \
  }                                                                                                       \
  void nn_check_fields() const {                                                                          \
    __VA_OPT__(NN_DETAIL_FOR_EACH(NN_DETAIL_CHECK_FIELD, __VA_ARGS__))                                    \
    static_assert(!::nn::detail::has_unlisted_members<Type, 0 __VA_OPT__(NN_DETAIL_FOR_EACH(              \
                                                                NN_DETAIL_COUNT_FIELD, __VA_ARGS__))>(), \
                  "NN_MODULE(" #Type ", ...): " #Type " has a data member that NN_MODULE does not list: "  \
                  "list each as a field (a module, nn::Param, nn::Buffer), as configuration in "         \
                  "NN_STATIC(...) (a compiled step records again when it changes), or in "               \
                  "NN_UNCHECKED(...)");                                                                   \
  }                                                                                                       \
  /** (path, tensor) of every Param and Buffer, in declaration order. */                                  \
  std::vector<std::pair<std::string, ::nn::Tensor>> parameters() const {                                  \
    return ::nn::detail::tree_parameters(*this, false);                                                   \
  }                                                                                                       \
  std::vector<std::pair<std::string, ::nn::Tensor>> trainable_parameters() const {                        \
    return ::nn::detail::tree_parameters(*this, true);                                                    \
  }                                                                                                       \
  std::int64_t num_params() const { return ::nn::detail::tree_count(*this, false); }                      \
  std::int64_t num_trainable() const { return ::nn::detail::tree_count(*this, true); }                    \
  std::string summary() const { return ::nn::detail::tree_summary(*this); }                               \
  std::string display() const { return ::nn::detail::tree_display(*this); }                               \
  template <class NnPred>                                                                                 \
  int freeze(NnPred pred) {                                                                               \
    return ::nn::detail::tree_set_trainable(*this, pred, false);                                          \
  }                                                                                                       \
  int freeze() {                                                                                          \
    return freeze([](const std::string&) { return true; });                                               \
  }                                                                                                       \
  template <class NnPred>                                                                                 \
  int unfreeze(NnPred pred) {                                                                             \
    return ::nn::detail::tree_set_trainable(*this, pred, true);                                           \
  }                                                                                                       \
  int unfreeze() {                                                                                        \
    return unfreeze([](const std::string&) { return true; });                                             \
  }                                                                                                       \
  void train(bool mode = true) { ::nn::detail::tree_train(*this, mode); }                                 \
  bool training() const { return nn_training_; }                                                          \
  template <class NnT, class NnPred, class NnF>                                                           \
  int map_modules(NnPred pred, NnF f) {                                                                   \
    ::nn::detail::ModuleMapper<NnT, NnPred, NnF> m{pred, f};                                              \
    m.recurse(*this, std::string());                                                                      \
    return m.count;                                                                                       \
  }                                                                                                       \
  void to(::nn::DType dt) { ::nn::detail::tree_to(*this, dt); }                                          \
  void to(::nn::Device nn_dev) { ::nn::detail::tree_to_device(*this, nn_dev); }                           \
  /** Every Param and Buffer to a safetensors file MLX loads (model.load_weights). */                    \
  void save_weights(const std::filesystem::path& nn_path) const {                                         \
    ::nn::detail::save_weights_impl(*this, nn_path, false);                                               \
  }                                                                                                       \
  /** Only the trainable Params (an adapter file). */                                                     \
  void save_trainable(const std::filesystem::path& nn_path) const {                                       \
    ::nn::detail::save_weights_impl(*this, nn_path, true);                                                \
  }                                                                                                       \
  /** Strict: every missing, unknown and mismatched name in one error; the model unchanged then. */      \
  void load_weights(const std::filesystem::path& nn_path) { ::nn::detail::load_weights_file(*this, nn_path, true); } \
  void load_weights(const ::nn::detail::NamedTensorList& nn_named) {                                      \
    ::nn::detail::load_weights_impl(*this, nn_named, true, "tensors");                                    \
  }                                                                                                       \
  /** Ignores unknown and missing names; shape and dtype must still match. */                            \
  void load_weights_partial(const std::filesystem::path& nn_path) {                                       \
    ::nn::detail::load_weights_file(*this, nn_path, false);                                               \
  }                                                                                                       \
  void load_weights_partial(const ::nn::detail::NamedTensorList& nn_named) {                              \
    ::nn::detail::load_weights_impl(*this, nn_named, false, "tensors");                                   \
  }

// SPDX-License-Identifier: MIT OR Apache-2.0
// GTape<Backend>: a Wengert list of primitive ops recorded in construction order (already a
// topological order), swept in reverse by backward(), and replayable without re-recording.
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <deque>
#include <new>
#include <optional>
#include <span>
#include <sstream>
#include <string>
#include <string_view>
#include <type_traits>
#include <unordered_set>
#include <utility>
#include <vector>

#include "anomaly.hpp"
#include "backend/policy.hpp"
#include "random.hpp"

namespace nn {

/// A handle to one value on a tape: the tape's identity and the node's index. Cheap to copy.
struct GVar {
  const void* tape = nullptr;
  std::int32_t index = -1;
  bool valid() const { return tape != nullptr && index >= 0; }
};

/// What kind of leaf a node is; ops are LeafKind::none.
enum class LeafKind : std::uint8_t { none, param, constant, input };

/// A node's attributes: each primitive declares its own struct (UnaryAttrs{op, arg},
/// AttentionAttrs{B, T, H, KV, head_dim, scale, causal}, ...), trivially copyable, kept in the
/// node by value, so a node is plain data that a replay or another backend runs again. A read
/// names the type it expects; reading another primitive's attributes is an error, not garbage.
class NodeAttrs {
 public:
  static constexpr std::size_t kBytes = 96;

  template <class A>
  void set(const A& a) {
    static_assert(std::is_trivially_copyable_v<A>, "a primitive's attributes are plain data");
    static_assert(sizeof(A) <= kBytes && alignof(A) <= alignof(std::max_align_t), "attributes too large for a node");
    ::new (static_cast<void*>(bytes_)) A(a);
    type_ = &tag<A>;
  }
  template <class A>
  const A& get() const {
    if (type_ != &tag<A>) detail::fail("tape", "a primitive read attributes of another type than it recorded");
    return *std::launder(reinterpret_cast<const A*>(bytes_));
  }

 private:
  template <class A>
  static constexpr char tag = 0;
  alignas(std::max_align_t) unsigned char bytes_[kBytes]{};
  const void* type_ = nullptr;
};

/// The attributes of a primitive that has none.
struct NoAttrs {};

template <class B>
class GTape;
template <class B>
struct Node;

/// A primitive's definition: which primitive (its name, for errors), its forward kernel call and
/// its vjp, side by side in the op's header. Nodes point at a static OpDef, so a node stays data,
/// not a closure.
template <class B>
struct OpDef {
  Prim prim;
  void (*forward)(GTape<B>&, Node<B>&);
  void (*vjp)(GTape<B>&, Node<B>&);
  bool aliases_input = false;  // forward makes value a view of input 0 (reshape): no output buffer
  // The kernel a primitive that runs several ran ("log" for a unary node), read from its
  // attributes, for errors; null when the primitive is one kernel.
  const char* (*kernel)(const Node<B>&) = nullptr;
  // Which values the vjp reads (their data, not only their shapes), for plan_memory: bit k is
  // input k's value (inputs past 30 are always taken as read), kVjpReadsOutput the node's own
  // output. Null: every input and the output (the safe default for a new primitive). A value no
  // later vjp reads can share its memory with other buffers once its forward consumers ran.
  std::uint32_t (*vjp_reads)(const GTape<B>&, const Node<B>&) = nullptr;
  // Input k whose gradient the vjp may write over k's value (element by element, each read
  // before it is written, nothing read after), so plan_memory may give both one block: the
  // cross-entropy's logits. -1: none.
  int vjp_overwrites = -1;
  constexpr const char* name() const { return prim_name(prim); }
};

/// OpDef::vjp_reads's bit for the node's own output value; bit k < 31 is input k's.
inline constexpr std::uint32_t kVjpReadsOutput = 1u << 31;
inline constexpr std::uint32_t vjp_reads_input(int k) { return 1u << k; }

/// An OpDef::vjp_reads for a vjp that always reads the same values (0: none, only shapes).
template <class B, std::uint32_t Mask>
std::uint32_t vjp_reads_fixed(const GTape<B>&, const Node<B>&) {
  return Mask;
}

/// One entry of the tape.
template <class B>
struct Node {
  const OpDef<B>* def = nullptr;  // null for leaves
  LeafKind leaf = LeafKind::none;
  std::vector<std::int32_t> inputs;
  NodeAttrs attrs;
  Tensor value;                   // the output, allocated when recorded, rewritten on replay
  Tensor grad;                    // d loss / d value, allocated on the first backward
  std::vector<Tensor> saved;      // buffers the op keeps between forward and vjp (and scratch)
  const Tensor* bound = nullptr;  // a param leaf's tensor, re-read on every replay
  bool requires_grad = false;
  bool grad_live = false;         // grad holds a contribution from the current backward
  std::int32_t pos = -1;          // its index on the tape
  std::int32_t scope = -1;        // the tape.scope() it was recorded in (GTape::scope_path), or -1
  std::int32_t segment = -1;      // the checkpoint segment it was recorded in (GTape::begin_segment), or -1
  // An intermediate of a closed checkpoint segment: its value, gradient and saved buffers are
  // views of the tape's segment pool, shared with every other segment, and hold its data only
  // while the backward sweep is inside its segment (which recomputes them first).
  bool pooled = false;
  // Its value and gradient are views of blocks that plan_memory() shares between buffers whose
  // lifetimes do not overlap: they hold its data only inside a replay, between its forward and
  // the last use the plan saw.
  bool planned = false;
  bool deferred = false;  // recorded by a deferred tape (defer_kernels): no value until plan_memory()
  // Absorbed by the fusion pass (ops/fused.hpp) into the fused node at this index, which now
  // computes its value inside its own loop: no def, no inputs, no buffers. -1: not absorbed.
  std::int32_t fused_into = -1;

  const char* name() const {
    if (def) return def->name();
    if (fused_into >= 0) return "(fused)";
    switch (leaf) {
      case LeafKind::param: return "param";
      case LeafKind::constant: return "constant";
      case LeafKind::input: return "input";
      default: return "?";
    }
  }
};

/// Where a vjp writes its contribution to one input's gradient: the buffer, and whether to add
/// to it (another consumer already wrote) or overwrite it (first contribution this sweep).
struct GradSlot {
  Tensor& g;
  bool acc;
};

/// What GTape::scope returns: while it lives, the nodes recorded are inside the scope (a layer
/// path, "model.layers.3.self_attn"), which anomaly mode's errors name. Ends at its destruction.
class [[nodiscard]] TapeScope {
 public:
  explicit TapeScope(std::vector<std::int32_t>& stack) : stack_(&stack) {}
  TapeScope(TapeScope&& o) noexcept : stack_(std::exchange(o.stack_, nullptr)) {}
  TapeScope(const TapeScope&) = delete;
  TapeScope& operator=(const TapeScope&) = delete;
  TapeScope& operator=(TapeScope&&) = delete;
  ~TapeScope() {
    if (stack_ && !stack_->empty()) stack_->pop_back();
  }

 private:
  std::vector<std::int32_t>* stack_;
};

/// The tape. Explicit object, passed to every builder; no global state, one tape per thread.
template <class B>
class GTape {
  static_assert(BackendPolicy<B>, "the tape's backend must satisfy nn::BackendPolicy");

 public:
  using backend = B;

  GTape() : anomaly_(detail::anomaly_from_env()) {}
  GTape(const GTape&) = delete;  // GVars name their tape by address
  GTape& operator=(const GTape&) = delete;

  // ---- leaves ------------------------------------------------------------------------------

  /// Binds `t` by reference: the leaf reads t's storage (updated in place by an optimizer, and
  /// re-read by a replay). Its gradient is computed when `trainable` and t is floating point.
  /// Binding the same tensor again returns the same leaf, so a weight used twice (a tied head)
  /// gets one gradient holding both contributions.
  GVar param(const Tensor& t, bool trainable = true) {
    check_leaf(t, "param");
    see_leaf_dtype(t.dtype());
    for (std::int32_t i : params_) {
      const Node<B>& p = nodes_[static_cast<std::size_t>(i)];
      if (p.bound == &t) {
        if (p.requires_grad != (trainable && is_floating(t.dtype())))
          detail::fail("param", "tensor ", t.shape().str(), " was bound ", p.requires_grad ? "trainable" : "frozen",
                       " and is now bound ", trainable ? "trainable" : "frozen");
        return GVar{this, i};
      }
    }
    params_.push_back(static_cast<std::int32_t>(nodes_.size()));
    Node<B>& n = push(LeafKind::param);
    n.value = t;
    n.bound = &t;
    n.requires_grad = trainable && is_floating(t.dtype());
    return checked_leaf();
  }
  /// A temporary cannot be bound: the leaf would point at a destroyed tensor. Keep the tensor in
  /// a variable (or a module's Param) that outlives the tape, or use constant() / input().
  GVar param(Tensor&&, bool = true) = delete;
  /// A value that never gets a gradient (shares t's storage).
  GVar constant(const Tensor& t) {
    check_leaf(t, "constant");
    see_leaf_dtype(t.dtype());
    Node<B>& n = push(LeafKind::constant);
    n.value = t;
    return checked_leaf();
  }
  /// A slot whose value set() may swap between replays (a batch). No gradient unless asked.
  GVar input(const Tensor& t, bool requires_grad = false) {
    check_leaf(t, "input");
    see_leaf_dtype(t.dtype());
    Node<B>& n = push(LeafKind::input);
    n.value = t;
    n.requires_grad = requires_grad && is_floating(t.dtype());
    return checked_leaf();
  }
  /// A fresh MLX key (uint32 (2)) from nn::random's global sequence, held in an input slot that
  /// refresh_keys() refills in recording order: how Dropout gets its key, so that a replayed step
  /// and an eager step draw the same keys (and so the same masks) from the same sequence.
  GVar random_key() {
    Tensor k = random::next_key();
    GVar v = input(B::device == Device::cpu ? k : k.to(B::device));  // the key lives where the tape runs
    key_slots_.push_back(v.index);
    return v;
  }
  /// Refills every random_key() slot with the global sequence's next keys (before a replay), in
  /// place: a device backend's slot keeps its buffer (a captured graph reads that address).
  void refresh_keys() {
    for (std::int32_t i : key_slots_) {
      Tensor& slot = nodes_[static_cast<std::size_t>(i)].value;
      if (slot.device() == Device::cpu) random::next_key_into(slot);
      else B::copy(random::next_key(), slot, false);  // an upload of the host-drawn key
    }
  }

  /// Puts a new value in an input slot; shape and dtype must match what was recorded (a new
  /// shape means a new recording).
  void set(GVar v, const Tensor& t) {
    Node<B>& n = node(v);
    if (n.leaf != LeafKind::input) fail_at(v, "set", "only input slots can be set; this is a ", n.name());
    if (!(t.shape() == n.value.shape()) || t.dtype() != n.value.dtype())
      detail::fail("tape.set", "input slot ", v.index, " was recorded as ", n.value.shape().str(), " ",
                   dtype_name(n.value.dtype()), ", got ", t.shape().str(), " ", dtype_name(t.dtype()),
                   " (a new shape needs a new recording)");
    n.value = t;
  }

  // ---- reading -----------------------------------------------------------------------------

  const Tensor& value(GVar v) const { return unpooled(v, "tape.value").value; }
  const Shape& shape(GVar v) const { return node(v).value.shape(); }
  DType dtype(GVar v) const { return node(v).value.dtype(); }
  bool requires_grad(GVar v) const { return node(v).requires_grad; }

  /// d loss / d v after backward(). Zeros when v needs a gradient the last backward never
  /// reached; an error when v cannot have one (a constant, a frozen param, an integer).
  const Tensor& grad(GVar v) {
    Node<B>& n = const_cast<Node<B>&>(unpooled(v, "tape.grad"));
    if (!n.requires_grad)
      detail::fail("tape.grad", "node ", v.index, " (", n.name(), ", shape ", n.value.shape().str(),
                   ") has no gradient: it does not depend on a trainable leaf");
    if (!n.grad_live) {
      ensure_grad(n);
      B::fill(n.grad, 0.0);
      n.grad_live = true;
    }
    return n.grad;
  }

  std::size_t size() const { return nodes_.size(); }
  /// The param leaf bound to `t`, if any (how value_and_grad finds each parameter's gradient).
  std::optional<GVar> find_param(const Tensor& t) const {
    for (std::int32_t i : params_)
      if (nodes_[static_cast<std::size_t>(i)].bound == &t) return GVar{this, i};
    return std::nullopt;
  }
  /// Forgets every node (a new recording); the tensors bound as params are not touched.
  void clear() {
    nodes_.clear();
    params_.clear();
    key_slots_.clear();
    segments_.clear();
    pool_.clear();
    blocks_.clear();
    placeholder_ = Tensor();
    deferred_count_ = 0;
    open_segment_ = -1;
    loss_ = -1;
    fused_programs_.clear();
    if (scope_stack_.empty()) scope_paths_.clear();  // an open scope keeps its path for what follows
    autocast_ = DType::f32;
    if (!float_dtype_set_) {
      float_dtype_seen_ = false;
      float_dtype_ = DType::f32;
    }
  }

  /// DType::bf16: the products recorded from now on whose right operand is a float32 matrix (a
  /// Linear's weight, a LoRA adapter) run on bf16-rounded operands with f32 accumulation, and so
  /// do both products of their backward, the input's gradient and the weight's
  /// (torch.autocast("cpu", dtype=torch.bfloat16) for matmul; nn keeps each product's f32 result
  /// where PyTorch rounds it to bf16). Operands and gradients stay float32 tensors. DType::f32
  /// (the default; also after clear()) records products in their own dtype. Each product keeps
  /// the choice it was recorded with, so a replay does what the recording did.
  void set_autocast(DType t) {
    if (t != DType::f32 && t != DType::bf16)
      detail::fail("tape", "autocast is float32 (off) or bfloat16, got ", dtype_name(t));
    autocast_ = t;
  }
  DType autocast() const { return autocast_; }

  /// The floating dtype this tape computes in, for what a builder makes without being told one
  /// (rope_fill's tables, causal_mask_fill's mask): set_float_dtype's, or else the dtype of the
  /// first float32 or float64 leaf bound to the tape (param, constant or input), or float32.
  DType float_dtype() const { return float_dtype_; }
  void set_float_dtype(DType t) {
    if (t != DType::f32 && t != DType::f64)
      detail::fail("tape", "the float dtype is float32 or float64, got ", dtype_name(t));
    float_dtype_ = t;
    float_dtype_set_ = true;
  }

  // ---- anomaly mode and scopes ------------------------------------------------------------------

  /// Anomaly mode (torch.autograd.detect_anomaly): every value is checked for NaN and Inf as it
  /// is produced -- each leaf as it is bound (and re-read on replay), each op's output after its
  /// forward, each gradient an op's vjp writes -- in eager recording and in replay. The first bad
  /// element raises nn::Error naming the op, its node index, its scope path (the layer), its
  /// inputs' shapes and the element's position. Off by default (one untaken branch per node);
  /// NN_DETECT_ANOMALY=1 in the environment turns it on for every tape made afterwards.
  void detect_anomaly(bool on) { anomaly_ = on; }
  bool detect_anomaly() const { return anomaly_; }

  /// Opens a scope named `name` inside the current one ("layers.3", then "self_attn" inside it
  /// makes "layers.3.self_attn"); it closes when the returned object is destroyed. Nodes
  /// recorded meanwhile carry the path, for errors:
  ///   { auto s = tp.scope("mlp"); x = mlp(tp, x); }
  TapeScope scope(std::string_view name) {
    std::string path(name);
    if (!scope_stack_.empty()) path = scope_paths_[static_cast<std::size_t>(scope_stack_.back())] + "." + path;
    scope_paths_.push_back(std::move(path));
    scope_stack_.push_back(static_cast<std::int32_t>(scope_paths_.size() - 1));
    return TapeScope(scope_stack_);
  }
  /// The scope path node v was recorded in ("" outside any scope).
  const std::string& scope_path(GVar v) const {
    static const std::string none;
    const std::int32_t s = node(v).scope;
    return s < 0 ? none : scope_paths_[static_cast<std::size_t>(s)];
  }

  // ---- backward ----------------------------------------------------------------------------

  /// Reverse sweep from a scalar loss (d loss / d loss = 1).
  void backward(GVar loss) {
    Node<B>& n = node(loss);
    if (n.value.numel() != 1)
      detail::fail("backward", "the loss must have one element, got shape ", n.value.shape().str(),
                   "; pass an explicit cotangent for a non-scalar output");
    begin_backward(n);
    B::fill(n.grad, 1.0);
    sweep(loss.index);
  }
  /// Reverse sweep from any output with an explicit cotangent of the output's shape.
  void backward(GVar out, const Tensor& cotangent) {
    Node<B>& n = node(out);
    if (!(cotangent.shape() == n.value.shape()) || cotangent.dtype() != n.value.dtype())
      detail::fail("backward", "cotangent ", cotangent.shape().str(), " ", dtype_name(cotangent.dtype()),
                   " does not match the output ", n.value.shape().str(), " ", dtype_name(n.value.dtype()));
    begin_backward(n);
    B::copy(cotangent, n.grad, false);
    if (anomaly_ && !detail::all_finite(n.grad)) report(out.index, n.grad, "the cotangent given to backward() holds");
    sweep(out.index);
  }

  // ---- replay ------------------------------------------------------------------------------

  /// Re-runs every recorded node into the buffers it already owns: params re-read from their
  /// bound tensors (which must keep their shape), inputs as last set(). Allocates nothing.
  void replay_forward() {
    require_materialised("tape.replay");
    for (std::size_t i = 0; i < nodes_.size(); ++i) {
      Node<B>& n = nodes_[i];
      if (n.leaf == LeafKind::param) {
        if (!(n.bound->shape() == n.value.shape()) || n.bound->dtype() != n.value.dtype())
          detail::fail("tape.replay", "a bound parameter changed from ", n.value.shape().str(), " to ",
                       n.bound->shape().str(), "; record the step again");
        n.value = *n.bound;
      } else if (n.def) {
        n.def->forward(*this, n);
      }
      if (anomaly_) check_value(static_cast<std::int32_t>(i));
    }
  }
  /// Replays the forward pass, then the last backward() from a scalar loss.
  void replay() {
    replay_forward();
    if (loss_ >= 0) backward(GVar{this, loss_});
  }

  // ---- memory planning (what a compiled step does: compile.hpp) ------------------------------

  /// Deferred recording: while on, an op recorded gets its output's shape and dtype but no
  /// memory and no kernel run (a reshape still views its input); plan_memory() then gives every
  /// op its buffer and replay() computes the values. A recording whose every buffer is live at
  /// once would otherwise set the process's peak memory before any plan could share them.
  /// Reading such a node's value or recording an op that checks data (an id out of range)
  /// before the replay: the value is an error to read, the data check runs on the replay.
  void defer_kernels(bool on) { deferred_ = on; }
  bool deferred_kernels() const { return deferred_; }

  /// Plans the tape for replay() from `out` (backward included when `backward` is set and `out`
  /// is a scalar that depends on a trainable leaf; an evaluation passes false), then keeps only what outlives a replay: leaves, `out`'s value
  /// and the leaves' gradients. Every other op value and gradient becomes a view of a shared
  /// block, lent to buffers whose lifetimes do not overlap. A value lives from its forward to
  /// its last use: the last op that reads it forward, or the last vjp that reads its data
  /// (OpDef::vjp_reads; quantized_matmul's vjp, for one, never reads x). A gradient lives from
  /// the first vjp that writes it to its own vjp. Saved buffers (tp.scratch) keep their own
  /// memory. Afterwards the planned nodes cannot be read (an nn::Error names the node) and the
  /// tape allocates nothing on replay. Returns the bytes the plan's blocks hold. With checkpoint
  /// segments, their pooled intermediates keep the segment pool (shared already); the rest is
  /// planned, a segment's inputs living until the backward sweep recomputes the segment.
  std::size_t plan_memory(GVar out, bool backward = true) {
    Node<B>& o = const_cast<Node<B>&>(unpooled(out, "plan_memory", true));
    if (open_segment_ >= 0) detail::fail("plan_memory", "a checkpoint segment is still open");
    loss_ = backward && o.requires_grad && o.value.numel() == 1 ? out.index : -1;
    const std::int64_t N = static_cast<std::int64_t>(nodes_.size());
    blocks_.clear();
    plan_blocks(out.index);
    for (Node<B>& n : nodes_) {  // what the plan did not place gets its own buffer
      if (n.deferred && !n.planned && !n.pooled) n.value = B::alloc(n.value.shape(), n.value.dtype());
      n.deferred = false;
    }
    deferred_count_ = 0;
    placeholder_ = Tensor();
    for (std::int64_t i = 0; i < N; ++i) {  // views follow their input onto its buffer
      Node<B>& n = nodes_[static_cast<std::size_t>(i)];
      if (n.def && n.def->aliases_input) n.def->forward(*this, n);
    }
    std::size_t total = 0;
    for (const Tensor& b : blocks_) total += b.storage_bytes();
    return total;
  }

  /// The three steps in one: records build() (which returns the output GVar) with its kernels
  /// deferred, plans the tape for that output and replays it once; returns the output, whose
  /// value (and, with `backward`, the leaves' gradients) is then read as usual.
  ///   GVar loss = tp.record_planned([&] { return cross_entropy(tp, model.logits(tp, ids), tg); }, false);
  template <class F>
  GVar record_planned(F&& build, bool backward = true) {
    const GVar out = record_deferred(std::forward<F>(build));
    plan_memory(out, backward);
    replay();
    return out;
  }
  /// The first step alone: records build() with its kernels deferred and returns its output, to
  /// be planned (plan_memory) before anything runs. A throw from build() leaves deferral off.
  template <class F>
  GVar record_deferred(F&& build) {
    defer_kernels(true);
    try {
      const GVar out = build();
      defer_kernels(false);
      return out;
    } catch (...) {
      defer_kernels(false);
      throw;
    }
  }

  // ---- checkpoint segments (nn::checkpoint, grad_checkpoint.hpp) --------------------------------

  /// Opens a checkpoint segment: the ops recorded until end_segment() are its nodes. Segments do
  /// not nest.
  void begin_segment() {
    if (open_segment_ >= 0) detail::fail("checkpoint", "checkpoint segments do not nest (one is already open)");
    segments_.push_back({static_cast<std::int32_t>(nodes_.size()), -1});
    open_segment_ = static_cast<std::int32_t>(segments_.size() - 1);
  }
  /// Closes the open segment. Its op nodes other than `outputs` (and what those view) become
  /// pooled: their buffers are lent to every segment in turn, so after this only the outputs may
  /// be read or used by later ops; the backward sweep recomputes the rest from the segment's
  /// inputs when it gets there.
  void end_segment(std::span<const GVar> outputs) {
    if (open_segment_ < 0) detail::fail("checkpoint", "end_segment without begin_segment");
    Segment& sg = segments_[static_cast<std::size_t>(open_segment_)];
    open_segment_ = -1;
    sg.end = static_cast<std::int32_t>(nodes_.size());
    std::vector<char> keep(static_cast<std::size_t>(sg.end - sg.begin), 0);
    for (GVar v : outputs) {
      node(v);
      if (v.index >= sg.begin) keep[static_cast<std::size_t>(v.index - sg.begin)] = 1;
    }
    for (std::int32_t i = sg.end - 1; i >= sg.begin; --i) {  // an output that views a node keeps it
      const Node<B>& n = nodes_[static_cast<std::size_t>(i)];
      if (keep[static_cast<std::size_t>(i - sg.begin)] && n.def && n.def->aliases_input && n.inputs[0] >= sg.begin)
        keep[static_cast<std::size_t>(n.inputs[0] - sg.begin)] = 1;
    }
    for (std::int32_t i = sg.begin; i < sg.end; ++i) {
      Node<B>& n = nodes_[static_cast<std::size_t>(i)];
      if (!n.def || keep[static_cast<std::size_t>(i - sg.begin)]) continue;
      n.pooled = true;
      sg.needs_grad = sg.needs_grad || n.requires_grad;
    }
    park(static_cast<std::int32_t>(segments_.size() - 1));
  }

  /// Closes the open segment (if any) without pooling anything: its nodes stay ordinary, as if
  /// never in a segment. How nn::checkpoint cleans up when the segment's function throws.
  void abandon_segment() {
    if (open_segment_ < 0) return;
    Segment& sg = segments_[static_cast<std::size_t>(open_segment_)];
    sg.end = static_cast<std::int32_t>(nodes_.size());
    for (std::int32_t i = sg.begin; i < sg.end; ++i) nodes_[static_cast<std::size_t>(i)].segment = -1;
    open_segment_ = -1;
  }

  /// The bytes of the buffers this tape holds (op values, gradients, saved buffers and the
  /// segment pool), each storage block counted once; leaves' tensors are not counted.
  std::size_t bytes() const {
    std::unordered_set<const void*> seen;
    std::size_t total = 0;
    auto count = [&](const Tensor& t) {
      if (t.defined() && seen.insert(t.raw()).second) total += t.storage_bytes();
    };
    for (const Node<B>& n : nodes_) {
      if (n.def && !n.def->aliases_input) count(n.value);
      count(n.grad);
      for (const Tensor& t : n.saved) count(t);
    }
    for (const Tensor& t : pool_) count(t);
    return total;
  }

  // ---- for op implementations ----------------------------------------------------------------

  /// Appends an op node with output shape/dtype, allocates its output, runs its forward.
  template <class A = NoAttrs>
  GVar record(const OpDef<B>& def, std::span<const GVar> inputs, const A& attrs, const Shape& out_shape,
              DType out_dtype) {
    for (GVar v : inputs) unpooled(v, def.name(), true);  // validates ownership; no checkpointed intermediate
    Node<B>& n = push(LeafKind::none);
    n.def = &def;
    n.attrs.set(attrs);
    n.inputs.reserve(inputs.size());
    for (GVar v : inputs) {
      n.inputs.push_back(v.index);
      n.requires_grad = n.requires_grad || nodes_[static_cast<std::size_t>(v.index)].requires_grad;
    }
    n.requires_grad = n.requires_grad && is_floating(out_dtype);
    if (def.aliases_input) {
    } else if (deferred_) {
      n.value = placeholder(out_shape, out_dtype);
      n.deferred = true;
      ++deferred_count_;
      return handle();  // the kernel runs on the first replay, into the buffer plan_memory gives it
    } else {
      n.value = B::alloc(out_shape, out_dtype);
    }
    try {
      def.forward(*this, n);
      if (anomaly_) check_value(static_cast<std::int32_t>(nodes_.size() - 1));
    } catch (...) {
      nodes_.pop_back();  // a failed op (an id out of range) leaves the tape as it was, replayable
      throw;
    }
    return handle();
  }

  Node<B>& node(GVar v) {
    check(v);
    return nodes_[static_cast<std::size_t>(v.index)];
  }
  const Node<B>& node(GVar v) const {
    check(v);
    return nodes_[static_cast<std::size_t>(v.index)];
  }
  Node<B>& at(std::int32_t i) { return nodes_[static_cast<std::size_t>(i)]; }
  /// Input k's value of node n.
  const Tensor& in(const Node<B>& n, std::size_t k) const {
    return nodes_[static_cast<std::size_t>(n.inputs[k])].value;
  }
  /// Whether a backward sweep will follow this forward of node n and reach it: a replay of a
  /// tape planned with its backward (plan_memory), or of one whose backward() already ran. A
  /// primitive whose vjp is cheapest computed inside its forward (linear_cross_entropy) does it
  /// then, and in its vjp otherwise.
  bool backward_follows(const Node<B>& n) const {
    return loss_ >= 0 && n.pos <= loss_ && n.requires_grad;
  }
  /// Whether input k of node n wants a gradient.
  bool needs_grad(const Node<B>& n, std::size_t k) const {
    return nodes_[static_cast<std::size_t>(n.inputs[k])].requires_grad;
  }
  /// The destination for input k's gradient (allocated once, reused by every later sweep).
  GradSlot grad_slot(const Node<B>& n, std::size_t k) {
    Node<B>& in = nodes_[static_cast<std::size_t>(n.inputs[k])];
    ensure_grad(in);
    bool acc = in.grad_live;
    in.grad_live = true;
    return {in.grad, acc};
  }
  /// The gradient destinations of inputs 0..N-1 of n, for a vjp kernel that writes them in one
  /// call ({nullptr, false} where an input needs none, or is past n's inputs). Inputs that are one
  /// node (attention's k = v, swiglu(x, x)) name one buffer: it is zeroed here once, unless it
  /// already holds a contribution, and every slot naming it accumulates, so the kernel may
  /// interleave its writes in any order and never tests whether its outputs overlap.
  template <std::size_t N>
  std::array<GradOut, N> grad_outs(Node<B>& n) {
    std::array<GradOut, N> out{};
    for (std::size_t k = 0; k < N && k < n.inputs.size(); ++k) {
      if (!needs_grad(n, k)) continue;
      std::size_t first = 0;
      while (n.inputs[first] != n.inputs[k]) ++first;
      if (first == k) {
        GradSlot s = grad_slot(n, k);
        out[k] = {&s.g, s.acc};
        continue;
      }
      // the same node again: its one buffer, zeroed once, every write to it accumulating
      if (!out[first].acc) {
        B::fill(*out[first].g, 0.0);
        out[first].acc = true;
      }
      out[k] = out[first];
    }
    return out;
  }
  /// Adds `full` (at the op output's broadcast shape) into input k's gradient, summed down to the
  /// input's shape: the one place broadcasting gradients are reduced.
  void accumulate_reduced(const Node<B>& n, std::size_t k, const Tensor& full) {
    GradSlot s = grad_slot(n, k);
    if (full.shape() == s.g.shape()) B::copy(full, s.g, s.acc);
    else B::sum_to(full, s.g, 1.0, s.acc);
  }
  /// Buffer `slot` of node n with the given shape and dtype, allocated the first time only.
  Tensor& scratch(Node<B>& n, std::size_t slot, const Shape& s, DType t) {
    if (n.saved.size() <= slot) n.saved.resize(slot + 1);
    Tensor& b = n.saved[slot];
    if (!b.defined() || !(b.shape() == s) || b.dtype() != t) b = B::alloc(s, t);
    return b;
  }

  /// The fused groups' programs (ops/fused.hpp): a fused node's attributes name one by index.
  /// A deque, so a program's address stays put while more are added.
  std::int32_t add_fused_program(const FusedProgram& p) {
    fused_programs_.push_back(p);
    return static_cast<std::int32_t>(fused_programs_.size() - 1);
  }
  const FusedProgram& fused_program(std::int32_t id) const { return fused_programs_[static_cast<std::size_t>(id)]; }

  /// Raises "[op] message" naming the node; used by ops when validating.
  template <class... P>
  [[noreturn]] void fail_at(GVar v, const char* op, const P&... parts) const {
    detail::fail(op, parts..., " (node ", v.index, ")");
  }

 private:
  DType autocast_ = DType::f32;  // set_autocast
  DType float_dtype_ = DType::f32;
  bool float_dtype_set_ = false, float_dtype_seen_ = false;
  /// Leaves tell the tape its float dtype, until one has (or set_float_dtype did).
  void see_leaf_dtype(DType t) {
    if (float_dtype_set_ || float_dtype_seen_ || (t != DType::f32 && t != DType::f64)) return;
    float_dtype_ = t;
    float_dtype_seen_ = true;
  }
  Node<B>& push(LeafKind k) {
    nodes_.emplace_back();
    nodes_.back().pos = static_cast<std::int32_t>(nodes_.size() - 1);
    nodes_.back().leaf = k;
    nodes_.back().scope = scope_stack_.empty() ? -1 : scope_stack_.back();
    nodes_.back().segment = open_segment_;
    return nodes_.back();
  }
  GVar handle() const { return GVar{this, static_cast<std::int32_t>(nodes_.size() - 1)}; }
  void check(GVar v) const {
    if (v.tape != this)
      detail::fail("tape", v.tape ? "the variable belongs to another tape" : "the variable is empty (default GVar)");
    if (v.index < 0 || static_cast<std::size_t>(v.index) >= nodes_.size())
      detail::fail("tape", "variable index ", v.index, " is out of range (", nodes_.size(), " nodes)");
  }
  static void check_leaf(const Tensor& t, const char* what) {
    if (!t.defined()) detail::fail(what, "cannot register an empty tensor");
    if (t.device() != B::device)
      detail::fail(what, "tensor ", t.shape().str(), " lives on ", t.device(), " but this tape runs on ", B::name);
  }
  static void ensure_grad(Node<B>& n) {
    if (!n.grad.defined()) n.grad = B::alloc(n.value.shape(), n.value.dtype());
  }
  void begin_backward(Node<B>& out) {
    if (!out.requires_grad)
      detail::fail("backward", "the output does not depend on any trainable parameter or input");
    for (auto& n : nodes_) n.grad_live = false;
    ensure_grad(out);
    out.grad_live = true;
  }
  void sweep(std::int32_t from) {
    if (open_segment_ >= 0) detail::fail("backward", "a checkpoint segment is still open (end_segment was not called)");
    require_materialised("backward");
    loss_ = nodes_[static_cast<std::size_t>(from)].value.numel() == 1 ? from : -1;
    // Entering a checkpoint segment (from above) recomputes its intermediates into the pool;
    // leaving it hands the pool back (after any gradient buffers its vjps made are parked there).
    std::int32_t active = -1;
    for (std::int32_t i = from; i >= 0; --i) {
      Node<B>& n = nodes_[static_cast<std::size_t>(i)];
      if (n.segment != active) {
        if (active >= 0) park(active);
        active = n.segment;
        if (active >= 0) recompute(active);
      }
      if (n.def && n.requires_grad && n.grad_live) {
        n.def->vjp(*this, n);
        if (anomaly_) check_grads(i);
      }
    }
    if (active >= 0) park(active);
  }

  // ---- anomaly mode ------------------------------------------------------------------------

  // A leaf is checked as it is bound; a failing one leaves the tape as it was.
  GVar checked_leaf() {
    if (anomaly_) {
      try {
        check_value(static_cast<std::int32_t>(nodes_.size() - 1));
      } catch (...) {
        if (nodes_.back().leaf == LeafKind::param) params_.pop_back();
        nodes_.pop_back();
        throw;
      }
    }
    return handle();
  }
  void check_value(std::int32_t i) {
    const Node<B>& n = nodes_[static_cast<std::size_t>(i)];
    if (!detail::all_finite(n.value)) report(i, n.value, n.def ? "forward produced" : "its value holds");
  }
  // After node i's vjp: the gradient it wrote into each input (each earlier contribution was
  // checked when it was written, so a bad element now comes from this vjp).
  void check_grads(std::int32_t i) {
    const Node<B>& n = nodes_[static_cast<std::size_t>(i)];
    for (std::size_t k = 0; k < n.inputs.size(); ++k) {
      if (!needs_grad(n, k)) continue;
      const Node<B>& in = nodes_[static_cast<std::size_t>(n.inputs[k])];
      if (!detail::all_finite(in.grad))
        report(i, in.grad, ("backward (vjp) wrote into the gradient of input " + std::to_string(k) + " (node " +
                            std::to_string(n.inputs[k]) + ", " + in.name() + ")")
                               .c_str());
    }
  }
  // "[anomaly] softmax (node 7, in 'layers.0.self_attn', inputs (2, 3) float32): forward produced
  // NaN at [1, 2] (element 5) of (2, 3) float32"
  [[noreturn]] void report(std::int32_t i, const Tensor& bad, const char* what) const {
    const Node<B>& n = nodes_[static_cast<std::size_t>(i)];
    std::ostringstream os;
    os << n.name();
    if (n.def && n.def->kernel) os << ' ' << n.def->kernel(n);  // "unary log"
    os << " (node " << i;
    if (n.scope >= 0) os << ", in '" << scope_paths_[static_cast<std::size_t>(n.scope)] << "'";
    if (!n.inputs.empty()) {
      os << ", inputs";
      for (std::size_t k = 0; k < n.inputs.size(); ++k) {
        const Tensor& v = nodes_[static_cast<std::size_t>(n.inputs[k])].value;
        os << (k ? ", " : " ") << v.shape().str() << ' ' << dtype_name(v.dtype());
      }
    }
    os << "): " << what << ' ' << detail::first_nonfinite(bad) << " of " << bad.shape().str() << ' '
       << dtype_name(bad.dtype());
    detail::fail("anomaly", os.str());
  }

  // ---- memory planning -----------------------------------------------------------------------

  // A deferred node's value: a view of one block that is never written (so never resident).
  Tensor placeholder(const Shape& s, DType t) {
    const std::size_t bytes = std::max<std::size_t>(static_cast<std::size_t>(s.numel()) * dtype_size(t), 1);
    if (!placeholder_.defined() || placeholder_.storage_bytes() < bytes)
      placeholder_ = B::alloc(Shape{static_cast<std::int64_t>(bytes)}, DType::u8);
    return placeholder_.view_as(s, t);
  }
  void require_materialised(const char* op) const {
    if (deferred_count_ > 0)
      detail::fail(op, deferred_count_, " nodes were recorded with their kernels deferred and have no buffers yet: "
                   "call plan_memory() first");
  }
  // Whether node j's vjp reads input k's data (true for k past the mask's bits).
  static bool mask_reads(std::uint32_t mask, std::size_t k) {
    return k >= 31 || (mask & vjp_reads_input(static_cast<int>(k))) != 0;
  }
  // plan_memory's placement. Time runs over the replay: node i's forward at step i, then (when
  // out is a loss) its vjp at step 2N - 1 - i, since the sweep visits nodes in reverse. Step t
  // has a read phase 2t and a write phase 2t + 1, and an ordinary use holds a buffer over both,
  // so an op never gets its output (or the gradients it writes) over a buffer it reads. A vjp
  // that writes input k's gradient over k's value (OpDef::vjp_overwrites) reads that value in
  // phase 2t only and writes the gradient from 2t + 1: the two may share a block. Buffers are
  // placed largest first into the first block whose members' intervals all miss it (a block is
  // as large as its largest buffer).
  void plan_blocks(std::int32_t out) {
    const std::int64_t N = static_cast<std::int64_t>(nodes_.size());
    const bool bwd = loss_ >= 0;
    auto at_vjp = [&](std::int64_t i) { return 2 * N - 1 - i; };
    constexpr std::int64_t kNever = -1;
    std::vector<std::int32_t> root(static_cast<std::size_t>(N));  // whose buffer a value is (views: their input's)
    std::vector<std::int64_t> last(static_cast<std::size_t>(N), kNever), first_grad(static_cast<std::size_t>(N), kNever);
    auto runs_vjp = [&](const Node<B>& n, std::int64_t i) { return bwd && n.def && n.requires_grad && i <= loss_; };
    for (std::int64_t i = 0; i < N; ++i) {
      const Node<B>& n = nodes_[static_cast<std::size_t>(i)];
      const std::size_t u = static_cast<std::size_t>(i);
      root[u] = n.def && n.def->aliases_input ? root[static_cast<std::size_t>(n.inputs[0])] : static_cast<std::int32_t>(i);
      last[u] = 2 * i + 1;
      if (!n.def) continue;
      const std::uint32_t mask = n.def->vjp_reads ? n.def->vjp_reads(*this, n) : ~0u;
      const std::int64_t v = 2 * at_vjp(i);
      for (std::size_t k = 0; k < n.inputs.size(); ++k) {
        std::int64_t& l = last[static_cast<std::size_t>(root[static_cast<std::size_t>(n.inputs[k])])];
        l = std::max(l, 2 * i + 1);  // its forward reads it
        if (runs_vjp(n, i) && mask_reads(mask, k))  // and so may its vjp
          l = std::max(l, n.def->vjp_overwrites == static_cast<int>(k) ? v : v + 1);
      }
      if (runs_vjp(n, i) && (mask & kVjpReadsOutput)) {
        std::int64_t& l = last[static_cast<std::size_t>(root[u])];
        l = std::max(l, v + 1);
      }
      if (n.pooled && bwd) {  // the sweep runs it forward again on entering its segment (from the top)
        const Segment& sg = segments_[static_cast<std::size_t>(n.segment)];
        const std::int64_t enter = 2 * at_vjp(std::min<std::int64_t>(sg.end - 1, loss_)) + 1;
        for (std::int32_t in : n.inputs) {
          std::int64_t& l = last[static_cast<std::size_t>(root[static_cast<std::size_t>(in)])];
          l = std::max(l, enter);
        }
      }
    }
    // A gradient is first written by the vjp of its last consumer (the sweep runs in reverse).
    for (std::int64_t j = N - 1; j >= 0; --j) {
      const Node<B>& n = nodes_[static_cast<std::size_t>(j)];
      if (!runs_vjp(n, j)) continue;
      for (std::size_t k = 0; k < n.inputs.size(); ++k) {
        const std::size_t in = static_cast<std::size_t>(n.inputs[k]);
        if (nodes_[in].requires_grad && first_grad[in] == kNever)
          first_grad[in] = 2 * at_vjp(j) + (n.def->vjp_overwrites == static_cast<int>(k) ? 1 : 0);
      }
    }
    struct Buf {
      Tensor* t;
      std::size_t bytes;
      std::int64_t begin, end;
      std::int32_t node;
    };
    std::vector<Buf> bufs;
    const std::int32_t out_root = root[static_cast<std::size_t>(out)];
    for (std::int64_t i = 0; i < N; ++i) {
      Node<B>& n = nodes_[static_cast<std::size_t>(i)];
      if (!n.def || i == out || n.pooled || nodes_[static_cast<std::size_t>(root[static_cast<std::size_t>(i)])].pooled) continue;
      const std::size_t bytes = static_cast<std::size_t>(n.value.numel()) * dtype_size(n.value.dtype());
      const std::int32_t r = root[static_cast<std::size_t>(i)];
      if (!n.def->aliases_input && i != out_root)
        bufs.push_back({&n.value, bytes, 2 * i, last[static_cast<std::size_t>(i)], static_cast<std::int32_t>(i)});
      if (bwd && n.requires_grad && i <= loss_ && r != out_root) {
        const std::int64_t f = first_grad[static_cast<std::size_t>(i)];
        bufs.push_back({&n.grad, bytes, f == kNever ? 2 * at_vjp(i) : f, 2 * at_vjp(i) + 1, static_cast<std::int32_t>(i)});
      }
      if (r != out_root && nodes_[static_cast<std::size_t>(r)].def) n.planned = true;
    }
    std::stable_sort(bufs.begin(), bufs.end(), [](const Buf& a, const Buf& b) { return a.bytes > b.bytes; });
    std::vector<std::vector<std::pair<std::int64_t, std::int64_t>>> lives;  // per block: its buffers' intervals
    for (const Buf& b : bufs) {
      std::size_t k = 0;
      for (; k < lives.size(); ++k) {
        bool free = true;
        for (const auto& [s, e] : lives[k])
          if (b.begin <= e && s <= b.end) {
            free = false;
            break;
          }
        if (free) break;
      }
      if (k == lives.size()) {
        lives.emplace_back();
        blocks_.push_back(B::alloc(Shape{static_cast<std::int64_t>(std::max<std::size_t>(b.bytes, 1))}, DType::u8));
      }
      lives[k].emplace_back(b.begin, b.end);
      const Node<B>& n = nodes_[static_cast<std::size_t>(b.node)];
      *b.t = blocks_[k].view_as(n.value.shape(), n.value.dtype());
    }
  }

  // ---- checkpoint segments -------------------------------------------------------------------

  struct Segment {
    std::int32_t begin, end;  // node range [begin, end)
    bool needs_grad = false;  // some pooled node wants a gradient: the sweep recomputes it
  };
  // Node v, which must not be a checkpointed intermediate (its buffers belong to the pool).
  const Node<B>& unpooled(GVar v, const char* op, bool deferred_ok = false) const {
    const Node<B>& n = node(v);
    if (n.pooled)
      detail::fail(op, "node ", v.index, " (", n.name(), ", ", n.value.shape().str(),
                   ") is an intermediate of a checkpoint segment, whose values are freed after the forward "
                   "pass; return it from the segment to use it outside");
    if (n.planned)
      detail::fail(op, "node ", v.index, " (", n.name(), ", ", n.value.shape().str(),
                   ") is an intermediate of a memory-planned tape (a compiled step), whose buffers are shared "
                   "with others once their last use has run; read it from an eager tape, or compile with "
                   "plan_memory(false)");
    if (n.fused_into >= 0)
      detail::fail(op, "node ", v.index, " was fused into node ", n.fused_into,
                   " (nn::fuse_elementwise: its value is computed inside that node's loop and never stored); "
                   "read it from a tape that is not fused");
    if (n.deferred && !deferred_ok)
      detail::fail(op, "node ", v.index, " (", n.name(), ", ", n.value.shape().str(),
                   ") was recorded with its kernel deferred (a compiled step's recording): it has no value "
                   "until the tape is planned and replayed");
    return n;
  }
  // Lends segment s's pooled buffers to the pool: value (not for a view), gradient, then saved,
  // each a view of pool block j for the next j. A buffer already on its block stays, so from the
  // second call on (a replay) nothing moves or allocates. What a buffer held is not kept.
  void park(std::int32_t s) {
    const Segment& sg = segments_[static_cast<std::size_t>(s)];
    std::size_t j = 0;
    auto lend = [&](Tensor& t, const Shape& shape, DType dt) {
      if (pool_.size() <= j) pool_.resize(j + 1);
      Tensor& block = pool_[j++];
      const std::size_t bytes = std::max<std::size_t>(static_cast<std::size_t>(shape.numel()) * dtype_size(dt), 1);
      if (!block.defined() || block.storage_bytes() < bytes)
        block = B::alloc(Shape{static_cast<std::int64_t>(bytes)}, DType::u8);
      if (!t.shares_storage(block)) t = block.view_as(shape, dt);
    };
    for (int pass = 0; pass < 2; ++pass)
      for (std::int32_t i = sg.begin; i < sg.end; ++i) {
        Node<B>& n = nodes_[static_cast<std::size_t>(i)];
        if (!n.pooled) continue;
        if (pass == 0) {
          if (!n.def->aliases_input) lend(n.value, n.value.shape(), n.value.dtype());
          if (n.requires_grad) lend(n.grad, n.value.shape(), n.value.dtype());  // made here, never by ensure_grad
        } else {
          for (Tensor& t : n.saved)
            if (t.defined()) lend(t, t.shape(), t.dtype());
        }
      }
    for (std::int32_t i = sg.begin; i < sg.end; ++i) {  // views follow their input onto its block
      Node<B>& n = nodes_[static_cast<std::size_t>(i)];
      if (n.pooled && n.def->aliases_input) n.def->forward(*this, n);
    }
  }
  // Runs segment s's pooled nodes forward again, into their pool views.
  void recompute(std::int32_t s) {
    const Segment& sg = segments_[static_cast<std::size_t>(s)];
    if (!sg.needs_grad || sg.end < 0) return;
    for (std::int32_t i = sg.begin; i < sg.end; ++i) {
      Node<B>& n = nodes_[static_cast<std::size_t>(i)];
      if (n.pooled) n.def->forward(*this, n);
    }
  }

  // A deque, not a vector: appending a node never moves the others, so a `const Tensor&` from
  // value() or grad() stays valid while more ops are recorded.
  std::deque<Node<B>> nodes_;
  std::vector<std::int32_t> params_;  // indices of param leaves, to find a re-bound tensor
  std::vector<std::int32_t> key_slots_;  // random_key() slots, refilled in order by refresh_keys()
  std::int32_t loss_ = -1;
  bool anomaly_ = false;                   // detect_anomaly
  std::vector<std::string> scope_paths_;   // every scope() opened since clear(), by id
  std::vector<std::int32_t> scope_stack_;  // the open scopes' ids, innermost last
  std::vector<Segment> segments_;          // checkpoint segments, in recording order
  std::vector<Tensor> pool_;               // the blocks pooled nodes' buffers view, by park()'s order
  std::int32_t open_segment_ = -1;         // the segment being recorded, or -1
  bool deferred_ = false;                  // defer_kernels
  std::int64_t deferred_count_ = 0;        // nodes recorded deferred and not yet given a buffer
  Tensor placeholder_;                     // what deferred nodes' values view (never written)
  std::vector<Tensor> blocks_;             // plan_memory's shared blocks
  std::deque<FusedProgram> fused_programs_;  // the fusion pass's programs, by id
};

}  // namespace nn

// A whole decode step of a Llama-style decoder (one new token per sequence, a few sequences)
// in one call: the token embeddings and rotary angles; per layer RMSNorm, the qkv product,
// q's and k's per-head norms (Qwen3), rotary positions on q and k (the half-split layout of
// Hugging Face's Llama) with k and v written to the cache, attention over the cache (within a
// sliding window in the layers that slide), the output product, residual add + RMSNorm,
// the gate/up product, SwiGLU, the down product, residual add + the next norm; then the logits,
// each row's greedy choice and whether the row is finite (the sampler's first questions).
//
// At batch 1 on SmolLM2 the step is bound by reading the weights; what is not a product was a
// third of it when each of these ran as its own call from Python (a few microseconds of
// dispatch each, thirty layers; benchmarks/RESULTS.md, "Decoding at batch 1"). Python's own
// work between steps slows too: the weights streamed through the caches leave the
// interpreter's and torch's dispatch data cold (a torch op on a few values took 0.15-0.3 ms
// right after a step, 0.03 ms warm), so the step leaves Python nothing but the sampler's
// bookkeeping.
//
// A product is one of: the packed fp32 kernel (small_gemm.h), the W8A8 kernel (int8_gemm.h, on
// CPUs with AVX-512 VNNI), torch's linear (MKL, for the rows where it measured faster on this
// machine) or a Python callable (any other layer); any of the first three may carry LoRA
// adapters applied per row (troupe.models.adapters). Products and attention split their work over
// torch's intra-op threads; the small operations between them run on the calling thread (a
// fork/join of the pool costs more than their work). fp32 only; decode_layers.py checks the
// model before it builds a Step.
// A part of native.cpp (included there in a namespace of its own), its bindings in bind().
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/linear.h>
#include <torch/csrc/utils/pybind.h>
#include <cmath>
#include <cstring>
#include <memory>
#include <tuple>
#include <vector>

#include "decode_attention.h"
#include "int8_gemm.h"
#include "small_gemm.h"
#include "vec16.h"

namespace {

using namespace troupe_vec;
namespace py = pybind11;

// silu(g) u = g sigmoid(g) u, with e = exp(-|g|) <= 1: sigmoid is 1 / (1 + e) for g >= 0 and
// e / (1 + e) below (no overflow either way)
inline v16 silu_times(v16 g, v16 u) {
  const v16 e = exp_nonpositive(g < 0 ? g : -g);
  const v16 s = (g < 0 ? e : splat(1.0f)) / (1.0f + e);
  return g * s * u;
}

inline float silu_times(float g, float u) {
  const float e = std::exp(-std::fabs(g));
  return g * (g < 0 ? e : 1.0f) / (1.0f + e) * u;
}

// y = x / rms(x) * w over a row of C values
void norm_row(const float *x, const float *w, float eps, int64_t C, float *y) {
  double ss = 0.0;  // in double: the order of the sum then barely matters
  for (int64_t c = 0; c < C; c++) ss += static_cast<double>(x[c]) * x[c];
  const float inv = 1.0f / std::sqrt(static_cast<float>(ss / C) + eps);
  for (int64_t c = 0; c < C; c++) y[c] = x[c] * inv * w[c];
}

// x += r (the residual stream, in place; r's rows ``r_row`` apart), then y = rms_norm(x) w
void add_norm(float *x, const float *r, int64_t r_row, const float *w, float eps, int64_t M,
              int64_t C, float *y) {
  for (int64_t m = 0; m < M; m++) {
    float *xm = x + m * C;
    const float *rm = r + m * r_row;
    for (int64_t c = 0; c < C; c++) xm[c] += rm[c];
    norm_row(xm, w, eps, C, y + m * C);
  }
}

// One linear layer of the step: y (M, out) = x (M, K) W^T + b, x contiguous. ``run`` returns
// y with rows ``row`` apart (the packed kernel writes whole blocks of 16: row >= n_out).
// With adapters (``lora_rank`` > 0), row m also gets B (A x) over the R columns of its
// adapter's slot ``slots[m]`` (none for -1): A (slots x R, K) and B (out, slots x R) packed as
// troupe.models.adapters.AdaptedLinear lays them out, the same sums in the same order.
struct Product {
  enum Kind { PACKED, INT8, TORCH, PYTHON } kind;
  int64_t n_out = 0;
  at::Tensor packed, weight;         // PACKED: (NB, K, 16) and the (N, K) weight for MKL's rows
  c10::optional<at::Tensor> bias;    // PACKED, TORCH: read at each call (trained in between)
  bool packed_few = true, packed_more = true;  // PACKED: which rows (<= 4, more) it takes
  at::Tensor colsum, scales;         // INT8 (the weight in ``packed``): small_gemm.py's docs
  c10::optional<at::Tensor> channels, channel_rows;  // INT8 outlier channels
  py::object fn;                     // PYTHON: rows -> rows
  at::Tensor lora_a, lora_b;         // the adapters' pairs, packed (see above)
  int64_t lora_rank = 0;

  at::Tensor run(const at::Tensor &x, int64_t *row, const int64_t *slots = nullptr) const {
    const int64_t M = x.size(0), K = x.size(1);
    at::Tensor y;
    switch (kind) {
      case PACKED:
        if (M <= 4 ? packed_few : packed_more) {
          const int64_t NB = packed.size(0);
          y = at::empty({M, NB * 16}, x.options());
          troupe_small_gemm::linear(x.data_ptr<float>(), M, K, packed.data_ptr<float>(), NB,
                                    nullptr, y.data_ptr<float>());
          if (bias.has_value()) {
            const float *b = bias->data_ptr<float>();
            float *yp = y.data_ptr<float>();
            for (int64_t m = 0; m < M; m++)
              for (int64_t n = 0; n < n_out; n++) yp[m * NB * 16 + n] += b[n];
          }
          break;
        }
        y = at::linear(x, weight, bias);
        break;
      case INT8:
#if TROUPE_VNNI
        y = at::empty({M, n_out}, x.options());
        troupe_int8::linear(x.data_ptr<float>(), M, K, packed.data_ptr<int8_t>(),
                            packed.size(0), colsum.data_ptr<int32_t>(),
                            scales.data_ptr<float>(),
                            bias.has_value() ? bias->data_ptr<float>() : nullptr, n_out,
                            channels.has_value() ? channels->numel() : 0,
                            channels.has_value() ? channels->data_ptr<int64_t>() : nullptr,
                            channel_rows.has_value() ? channel_rows->data_ptr<float>() : nullptr,
                            y.data_ptr<float>());
#else
        TORCH_CHECK(false, "decode_layer: an INT8 product in a build without AVX-512 VNNI");
#endif
        break;
      case TORCH:
        y = at::linear(x, weight, bias);
        break;
      case PYTHON:
        y = fn(x).cast<at::Tensor>().contiguous();
        break;
    }
    TORCH_CHECK(y.dim() == 2 && y.size(0) == M && y.size(1) >= n_out && y.stride(1) == 1 &&
                y.scalar_type() == at::kFloat, "decode_layer: a product gave ", y.sizes(),
                " for ", M, " rows of ", n_out, " outputs");
    *row = y.stride(0);
    if (lora_rank > 0 && slots != nullptr) add_adapters(x, slots, y, *row);
    return y;
  }

  // The adapters' products run with at least two rows: the kernel sums a single row in
  // another order (small_gemm.h's blocks1), and a row's delta must not depend on how many rows
  // share the step (troupe.models.adapters.AdaptedLinear pads the same way).
  void add_adapters(const at::Tensor &x, const int64_t *slots, at::Tensor &y, int64_t row) const {
    const int64_t M = x.size(0), K = x.size(1), R = lora_rank, P = std::max<int64_t>(M, 2);
    const int64_t NA = lora_a.size(0), L = lora_b.size(1), NB = lora_b.size(0);
    bool any = false;  // a step whose rows all run the base alone computes nothing here
    for (int64_t m = 0; m < M; m++) {
      TORCH_CHECK((slots[m] + 1) * R <= L, "decode_layer: adapter slot ", slots[m], " of row ",
                  m, " is not loaded on this layer");
      any = any || slots[m] >= 0;
    }
    if (!any) return;
    auto low = at::empty({P, NA * 16}, x.options());
    auto rows = at::zeros({P, K}, x.options());
    std::memcpy(rows.data_ptr<float>(), x.data_ptr<float>(), M * K * sizeof(float));
    troupe_small_gemm::linear(rows.data_ptr<float>(), P, K, lora_a.data_ptr<float>(), NA,
                              nullptr, low.data_ptr<float>());
    auto kept = at::zeros({P, L}, x.options());  // each row keeps its adapter's R columns
    const float *lp = low.data_ptr<float>();
    float *kp = kept.data_ptr<float>();
    for (int64_t m = 0; m < M; m++)
      if (slots[m] >= 0)
        std::memcpy(kp + m * L + slots[m] * R, lp + m * NA * 16 + slots[m] * R,
                    R * sizeof(float));
    auto delta = at::empty({P, NB * 16}, x.options());
    troupe_small_gemm::linear(kp, P, L, lora_b.data_ptr<float>(), NB, nullptr,
                              delta.data_ptr<float>());
    const float *dp = delta.data_ptr<float>();
    float *yp = y.data_ptr<float>();
    for (int64_t m = 0; m < M; m++)
      if (slots[m] >= 0)
        for (int64_t n = 0; n < n_out; n++) yp[m * row + n] += dp[m * NB * 16 + n];
  }
};

using ProductPtr = std::shared_ptr<Product>;

struct Layer {
  at::Tensor ln1, ln2;
  ProductPtr qkv, proj, fc, down;
  c10::optional<at::Tensor> q_norm, k_norm;  // per-head RMSNorm weights (D) of q and k (Qwen3)
  bool slides;                               // attends within the step's sliding window
};

// The model's layers, their products and norms: ``run`` is one decode step through them.
class Step {
 public:
  // layers: (ln1, ln2, qkv, proj, fc, down, q_norm, k_norm, slides) each, the norms of q and k
  // None where the model has none; C: the model's width (H heads of D need not span it);
  // embedding: the (V, C) fp32 token embedding, or absent (then ``run`` is given the
  // embeddings); inv_freq: the rotary frequencies (D/2), and rope_scale what the cosines and
  // sines are multiplied by (YaRN's attention factor, else 1); window: the sliding window of
  // the layers that slide (0: none); head: the logits' product, or absent (then ``logits``
  // cannot be asked for)
  Step(std::vector<py::tuple> layers, at::Tensor final_norm, int64_t C, int64_t H, int64_t Hkv,
       int64_t D, double eps, c10::optional<at::Tensor> embedding, at::Tensor inv_freq,
       double rope_scale, int64_t window, c10::optional<ProductPtr> head)
      : final_norm_(final_norm), C_(C), H_(H), Hkv_(Hkv), D_(D), eps_(eps),
        rope_scale_(rope_scale), window_(window), embedding_(embedding),
        inv_freq_(inv_freq.contiguous()), head_(head.value_or(nullptr)) {
    for (const auto &t : layers) {
      auto norm = [&](int i) {
        return t[i].is_none() ? c10::optional<at::Tensor>() : t[i].cast<at::Tensor>();
      };
      layers_.push_back({t[0].cast<at::Tensor>(), t[1].cast<at::Tensor>(),
                         t[2].cast<ProductPtr>(), t[3].cast<ProductPtr>(),
                         t[4].cast<ProductPtr>(), t[5].cast<ProductPtr>(), norm(6), norm(7),
                         t[8].cast<bool>()});
      TORCH_CHECK(!layers_.back().slides || window > 0,
                  "decode_layer: a layer slides but the step has no window");
    }
  }

  // tokens (B) int64: one new token per sequence; x (B, C): their embeddings when the step has
  // no embedding of its own (else absent); valid (B, S): which cache columns hold real tokens
  // (row m's last one, cols[m], this token's; a token's position is its row's count of them,
  // less one); ks, vs: every layer's (B, Hkv, >= S, D) caches, row m written at column cols[m]
  // (B int64: rows of one length, or each its own); slots (B) int64: each row's adapter slot
  // (-1: none; absent: no row has one); rows (B) int64: the cache row each row reads and writes
  // (absent: its own index), so that several rows may be one sequence's consecutive tokens (a
  // speculative verify: each at its own column, seeing the columns before it, which the rows
  // before it in this call wrote). Returns the final hidden states (B, C), after the last norm.
  at::Tensor run(at::Tensor tokens, c10::optional<at::Tensor> given, at::Tensor valid,
                 std::vector<at::Tensor> ks, std::vector<at::Tensor> vs, at::Tensor cols,
                 c10::optional<at::Tensor> slots, c10::optional<at::Tensor> rows) {
    const int64_t B = valid.size(0), C = C_, H = H_, Hkv = Hkv_, D = D_, half = D / 2;
    const int64_t S = valid.size(1);
    TORCH_CHECK(cols.is_contiguous() && cols.numel() == B && cols.scalar_type() == at::kLong,
                "decode_layer: cols must be ", B, " contiguous int64 values");
    const int64_t *colp = cols.data_ptr<int64_t>();
    TORCH_CHECK(!rows.has_value() || (rows->is_contiguous() && rows->numel() == B &&
                                      rows->scalar_type() == at::kLong),
                "decode_layer: rows must be ", B, " contiguous int64 values");
    const int64_t *rp = rows.has_value() ? rows->data_ptr<int64_t>() : nullptr;
    const int64_t cache_rows = ks.empty() ? 0 : ks[0].size(0);
    for (int64_t m = 0; rp && m < B; m++)
      TORCH_CHECK(rp[m] >= 0 && rp[m] < cache_rows, "decode_layer: row ", m, " reads cache row ",
                  rp[m], " of ", cache_rows);
    for (int64_t m = 0; m < B; m++)
      TORCH_CHECK(colp[m] >= 0 && colp[m] < S && valid.data_ptr<bool>()[m * S + colp[m]],
                  "decode_layer: row ", m, "'s column ", colp[m], " is not a valid one of ", S);
    TORCH_CHECK(!slots.has_value() || (slots->is_contiguous() && slots->numel() == B &&
                                       slots->scalar_type() == at::kLong),
                "decode_layer: slots must be ", B, " contiguous int64 values");
    const int64_t *sl = slots.has_value() ? slots->data_ptr<int64_t>() : nullptr;
    const int64_t L = static_cast<int64_t>(layers_.size());
    at::Tensor x = embed(tokens, given, B, C);
    TORCH_CHECK(static_cast<int64_t>(ks.size()) == L && static_cast<int64_t>(vs.size()) == L,
                "decode_layer: ", L, " layers' caches expected");
    TORCH_CHECK(valid.is_contiguous() && valid.scalar_type() == at::kBool && valid.dim() == 2,
                "decode_layer: valid must be a contiguous (B, S) bool tensor");
    for (int64_t i = 0; i < L; i++)
      TORCH_CHECK(ks[i].scalar_type() == at::kFloat && vs[i].scalar_type() == at::kFloat &&
                  (rp || ks[i].size(0) == B) && ks[i].size(1) == Hkv && ks[i].size(3) == D &&
                  ks[i].sizes() == vs[i].sizes() && ks[i].stride(3) == 1 &&
                  vs[i].stride(3) == 1 && ks[i].size(2) >= S,
                  "decode_layer: layer ", i, "'s cache is not (", B, ", ", Hkv, ", >= ", S,
                  ", ", D, ") float32");
    const float eps = static_cast<float>(eps_), scale = 1.0f / std::sqrt(static_cast<float>(D));
    float *xp = x.data_ptr<float>();
    // rotary angles: position p of a row times each frequency, in fp32 as the model's are
    // (times rope_scale); the keys a sliding layer sees: real, and less than the window behind
    std::vector<float> cosines(B * half), sines(B * half);
    const bool *vp_all = valid.data_ptr<bool>();
    std::vector<char> near(window_ > 0 ? B * S : 0);
    const float *freq = inv_freq_.data_ptr<float>();
    const float rs = static_cast<float>(rope_scale_);
    for (int64_t m = 0; m < B; m++) {
      const bool *vm = vp_all + m * S;
      int64_t count = 0;
      for (int64_t c = 0; c < S; c++) count += vm[c];
      const float p = static_cast<float>(count - 1);
      for (int64_t j = 0; j < half; j++) {
        const float angle = p * freq[j];
        cosines[m * half + j] = std::cos(angle) * rs;  // exact where rs is 1
        sines[m * half + j] = std::sin(angle) * rs;
      }
      for (int64_t c = 0, before = 0; window_ > 0 && c < S; c++) {
        near[m * S + c] = vm[c] && count - 1 - before < window_;  // key at ``before``
        before += vm[c];
      }
    }
    const bool *near_p = reinterpret_cast<const bool *>(near.data());
    const float *cp = cosines.data(), *sp = sines.data();
    auto h = at::empty({B, C}, x.options());
    auto q = at::empty({B, H, D}, x.options());
    auto y = at::empty({B, H * D}, x.options());
    std::vector<float> normed(D);  // one head of q or k after its norm
    float *hp = h.data_ptr<float>(), *qp = q.data_ptr<float>();
    for (int64_t m = 0; m < B; m++)
      norm_row(xp + m * C, layers_[0].ln1.data_ptr<float>(), eps, C, hp + m * C);
    for (int64_t i = 0; i < L; i++) {
      const Layer &layer = layers_[i];
      int64_t row;
      // q, k, v: rotary positions on q and k, k and v into each row's column cols[m]
      const at::Tensor qkv = layer.qkv->run(h, &row, sl);
      const float *src = qkv.data_ptr<float>();
      float *kp = ks[i].data_ptr<float>(), *vp = vs[i].data_ptr<float>();
      auto rotate = [&](const float *in, const float *c, const float *s, float *out) {
        for (int64_t j = 0; j < half; j++) {
          const float x1 = in[j], x2 = in[half + j];
          out[j] = x1 * c[j] - x2 * s[j];
          out[half + j] = x2 * c[j] + x1 * s[j];
        }
      };
      // a head of q or k, through its norm when the layer has one (Qwen3), before rotation
      auto head = [&](const float *in, const c10::optional<at::Tensor> &w) -> const float * {
        if (!w.has_value()) return in;
        norm_row(in, w->data_ptr<float>(), eps, D, normed.data());
        return normed.data();
      };
      for (int64_t m = 0; m < B; m++) {
        const float *r = src + m * row, *c = cp + m * half, *s = sp + m * half;
        for (int64_t hh = 0; hh < H; hh++)
          rotate(head(r + hh * D, layer.q_norm), c, s, qp + (m * H + hh) * D);
        for (int64_t hh = 0; hh < Hkv; hh++) {
          const int64_t cr = rp ? rp[m] : m;  // the cache row
          float *kd = kp + cr * ks[i].stride(0) + hh * ks[i].stride(1) + colp[m] * ks[i].stride(2);
          float *vd = vp + cr * vs[i].stride(0) + hh * vs[i].stride(1) + colp[m] * vs[i].stride(2);
          rotate(head(r + (H + hh) * D, layer.k_norm), c, s, kd);
          std::memcpy(vd, r + (H + Hkv + hh) * D, D * sizeof(float));
        }
      }
      const troupe_attention::Layout a{
          B, H, Hkv, S, D,
          qp, H * D, D,
          kp, ks[i].stride(0), ks[i].stride(1), ks[i].stride(2),
          vp, vs[i].stride(0), vs[i].stride(1), vs[i].stride(2),
          layer.slides ? near_p : valid.data_ptr<bool>(), y.data_ptr<float>(), rp};
      troupe_attention::decode(a, scale);
      // the output product, the residual, the MLP's norm
      const at::Tensor o = layer.proj->run(y, &row, sl);
      add_norm(xp, o.data_ptr<float>(), row, layer.ln2.data_ptr<float>(), eps, B, C, hp);
      // SwiGLU: [gate | up] = h W_fc^T, silu(gate) * up, the down product
      const at::Tensor g = layer.fc->run(h, &row, sl);
      const int64_t F = layer.fc->n_out / 2;
      auto act = at::empty({B, F}, x.options());
      const float *gp = g.data_ptr<float>();
      float *ap = act.data_ptr<float>();
      for (int64_t m = 0; m < B; m++) {
        const float *gate = gp + m * row, *up = gate + F;
        float *out = ap + m * F;
        int64_t f = 0;
        for (; f + 16 <= F; f += 16) st(out + f, silu_times(ld(gate + f), ld(up + f)));
        for (; f < F; f++) out[f] = silu_times(gate[f], up[f]);
      }
      const at::Tensor d = layer.down->run(act, &row, sl);
      const at::Tensor &norm = i + 1 < L ? layers_[i + 1].ln1 : final_norm_;
      add_norm(xp, d.data_ptr<float>(), row, norm.data_ptr<float>(), eps, B, C, hp);
    }
    return h;
  }

  // ``run``, then the logits (B, V) of its hidden states, each row's greedy choice (the first
  // index of its largest value) and whether the row is finite
  std::tuple<at::Tensor, at::Tensor, at::Tensor> logits(at::Tensor tokens,
                                                        c10::optional<at::Tensor> given,
                                                        at::Tensor valid,
                                                        std::vector<at::Tensor> ks,
                                                        std::vector<at::Tensor> vs, at::Tensor cols,
                                                        c10::optional<at::Tensor> slots,
                                                        c10::optional<at::Tensor> rows) {
    TORCH_CHECK(head_, "decode_layer: this step was built without the logits' product");
    const at::Tensor h = run(tokens, given, valid, ks, vs, cols, slots, rows);
    int64_t row;
    at::Tensor out = head_->run(h, &row);
    const int64_t B = h.size(0), V = head_->n_out;
    auto greedy = at::empty({B}, h.options().dtype(at::kLong));
    auto finite = at::empty({B}, h.options().dtype(at::kBool));
    const float *lp = out.data_ptr<float>();
    for (int64_t m = 0; m < B; m++) {
      const float *r = lp + m * row;
      v16 best = splat(-INFINITY), bad = splat(0.0f);
      int64_t v = 0;
      for (; v + 16 <= V; v += 16) {
        const v16 x = ld(r + v);
        best = x > best ? x : best;
        bad += x - x;  // 0 for a finite x, NaN for an infinity or a NaN
      }
      float top = -INFINITY, sum_bad = 0.0f;
      for (int i = 0; i < 16; i++) top = std::max(top, best[i]), sum_bad += bad[i];
      for (; v < V; v++) top = std::max(top, r[v]), sum_bad += r[v] - r[v];
      int64_t at = 0;
      while (at < V && r[at] != top) at++;
      finite.data_ptr<bool>()[m] = sum_bad == 0.0f && std::isfinite(top);
      greedy.data_ptr<int64_t>()[m] = at < V ? at : 0;
    }
    if (row != V) out = out.narrow(1, 0, V);
    return {out, greedy, finite};
  }

 private:
  // x (B, C), the residual stream: the given embeddings (copied: the step changes x in place)
  // or the token embedding's rows
  at::Tensor embed(const at::Tensor &tokens, const c10::optional<at::Tensor> &given, int64_t B,
                   int64_t C) const {
    if (given.has_value()) {
      TORCH_CHECK(given->dim() == 2 && given->size(0) == B && given->size(1) == C &&
                  given->scalar_type() == at::kFloat,
                  "decode_layer: the embeddings must be (", B, ", ", C, ") float32");
      return given->contiguous().clone();
    }
    TORCH_CHECK(embedding_.has_value(), "decode_layer: this step has no embedding: give x");
    TORCH_CHECK(tokens.numel() == B && tokens.scalar_type() == at::kLong,
                "decode_layer: tokens must be ", B, " int64 values");
    const at::Tensor t = tokens.contiguous();
    const int64_t V = embedding_->size(0);
    auto x = at::empty({B, C}, embedding_->options());
    for (int64_t m = 0; m < B; m++) {
      const int64_t id = t.data_ptr<int64_t>()[m];
      TORCH_CHECK(id >= 0 && id < V, "decode_layer: token ", id, " of row ", m,
                  " is outside the vocabulary (", V, ")");
      std::memcpy(x.data_ptr<float>() + m * C, embedding_->data_ptr<float>() + id * C,
                  C * sizeof(float));
    }
    return x;
  }

  std::vector<Layer> layers_;
  at::Tensor final_norm_;
  int64_t C_, H_, Hkv_, D_;
  double eps_, rope_scale_;
  int64_t window_;
  c10::optional<at::Tensor> embedding_;
  at::Tensor inv_freq_;
  ProductPtr head_;
};

}  // namespace

void bind(pybind11::module_ m) {
  py::class_<Product, ProductPtr>(m, "Product");
  m.def("packed", [](at::Tensor packed, at::Tensor weight, c10::optional<at::Tensor> bias,
                     int64_t n_out, bool few, bool more) {
    auto p = std::make_shared<Product>();
    p->kind = Product::PACKED;
    p->packed = packed, p->weight = weight, p->bias = bias, p->n_out = n_out;
    p->packed_few = few, p->packed_more = more;
    return p;
  });
  m.def("int8", [](at::Tensor packed, at::Tensor colsum, at::Tensor scales,
                   c10::optional<at::Tensor> bias, int64_t n_out,
                   c10::optional<at::Tensor> channels, c10::optional<at::Tensor> channel_rows) {
    TORCH_CHECK(TROUPE_VNNI, "decode_layer: this build has no AVX-512 VNNI");
    auto p = std::make_shared<Product>();
    p->kind = Product::INT8;
    p->packed = packed, p->colsum = colsum, p->scales = scales, p->bias = bias;
    p->n_out = n_out, p->channels = channels, p->channel_rows = channel_rows;
    return p;
  });
  m.def("torch", [](at::Tensor weight, c10::optional<at::Tensor> bias) {
    auto p = std::make_shared<Product>();
    p->kind = Product::TORCH;
    p->weight = weight, p->bias = bias, p->n_out = weight.size(0);
    return p;
  });
  m.def("python", [](py::object fn, int64_t n_out) {
    auto p = std::make_shared<Product>();
    p->kind = Product::PYTHON;
    p->fn = fn, p->n_out = n_out;
    return p;
  });
  // ``base`` with adapters: A (slots x R, K) and B (out, slots x R) packed (small_gemm.pack)
  m.def("lora", [](ProductPtr base, at::Tensor a, at::Tensor b, int64_t rank) {
    TORCH_CHECK(base->kind != Product::PYTHON, "decode_layer: adapters over a Python product");
    TORCH_CHECK(a.dim() == 3 && b.dim() == 3 && a.size(2) == 16 && b.size(2) == 16 &&
                b.size(0) * 16 >= base->n_out && rank > 0 && b.size(1) % rank == 0 &&
                a.size(0) * 16 >= b.size(1) && a.scalar_type() == at::kFloat &&
                b.scalar_type() == at::kFloat && a.is_contiguous() && b.is_contiguous(),
                "decode_layer: adapters' packed pairs do not fit the layer");
    auto p = std::make_shared<Product>(*base);
    p->lora_a = a, p->lora_b = b, p->lora_rank = rank;
    return p;
  });
  py::class_<Step>(m, "Step")
      .def(py::init<std::vector<py::tuple>, at::Tensor, int64_t, int64_t, int64_t, int64_t,
                    double, c10::optional<at::Tensor>, at::Tensor, double, int64_t,
                    c10::optional<ProductPtr>>())
      .def("run", &Step::run, py::arg("tokens"), py::arg("given"), py::arg("valid"),
           py::arg("ks"), py::arg("vs"), py::arg("cols"), py::arg("slots") = py::none(),
           py::arg("rows") = py::none())
      .def("logits", &Step::logits, py::arg("tokens"), py::arg("given"), py::arg("valid"),
           py::arg("ks"), py::arg("vs"), py::arg("cols"), py::arg("slots") = py::none(),
           py::arg("rows") = py::none());
}

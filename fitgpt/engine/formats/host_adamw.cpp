// One AdamW step over compact optimizer state in host RAM, in a single pass per element.
// Loaded by fitgpt/engine/hostkernel.py (which says why it exists and how it is built).
//
// Per element i of [lo, hi): the fp32 master is joined from the bf16 working weight w and the
// int16 remainder rem (a "split" master, engine/compact.py) or read from an fp32 master; the
// moments m and v are decoded from bf16 or block-wise int8 (engine/moments.py); AdamW steps
// them with the bf16 gradient g times hp.mul; everything is written back in its format. Bytes
// per element: split + bf16 read 10, write 8 (fp32 state through torch's kernel: ~40).
//
// Formats match the Python stores bit for bit: bf16 is round-to-nearest-even as torch casts
// (a NaN becomes 0x7FC0); the split is compact.split_master's; int8 is Int8Store's (m: absmax
// per block of BLOCK elements, q = nearest-even(x * 127/absmax); v: sqrt(v) in uint8 by 255/max,
// the bottom bucket decodes to its top). The AdamW is torch's fused kernel's formula,
//     p *= 1 - lr*wd;  m += (1 - b1)(g - m);  v = b2 v + (1 - b2) g g;
//     p -= lr/bc1 * m / (sqrt(v)/bc2_sqrt + eps),
// in IEEE fp32 without contraction (built with -ffp-contract=off): its results may differ from
// torch's vectorized kernel in the last bit of an element, so a narrow moment can round to the
// neighbouring value.
#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

constexpr int64_t BLOCK = 2048;  // engine/moments.py BLOCK; hostkernel.py checks they agree

inline float bf16_to_f32(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint32_t bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

inline float from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// torch's cast: round to nearest, ties to even; any NaN to the canonical quiet NaN. Branch-free
// so that the compiler vectorizes the loops that call it.
inline uint16_t f32_to_bf16(float f) {
  const uint32_t u = bits(f);
  const uint16_t r = static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
  return f != f ? static_cast<uint16_t>(0x7FC0) : r;
}

struct Hyper {
  float lr, b1, b2, eps, wd, bc1, bc2_sqrt, mul;
};

struct State {
  uint16_t* w;
  int16_t* rem;
  float* master32;
  const uint16_t* g;
  uint16_t* m16;
  int8_t* mq;
  float* ms;
  uint16_t* v16;
  uint8_t* vq;
  float* vs;
};

// Elements [a, b) of one block (or of a bf16 range), decay the weight-decay factor (1: none).
// SPLIT: the master is w + rem, else master32; INT8: the new moments go to mb/vb (the caller
// encodes the block), else straight to bf16. Template arguments, so each loop is branch-free.
// h by value: a local copy that no store can reach. Through a reference, a float store
// (master32) might overwrite it, so GCC reloaded its fields every element; with an fp32 master
// and int8 moments one reload landed after the loop's exit test, where if-conversion gives up,
// and that loop stayed scalar (1.76x fp32 state's time on the H100 host, 0.50x when split).
template <bool SPLIT, bool INT8>
inline void step_range(const State& s, const Hyper h, int64_t a, int64_t b, float decay,
                       float msc, float vsc, float* mb, float* vb) {
  const float step_size = h.lr / h.bc1, c1 = 1.0f - h.b1, c2 = 1.0f - h.b2;
  // the float arrays never alias one another or the 16-bit ones (w may alias g: an fp32
  // master's staging buffer, read then written per element, so it is not marked)
  float* __restrict master32 = s.master32;
  float* __restrict mbr = mb;
  float* __restrict vbr = vb;
  for (int64_t i = a; i < b; ++i) {
    float p = SPLIT ? from_bits((static_cast<uint32_t>(s.w[i]) << 16) +
                                static_cast<uint32_t>(static_cast<int32_t>(s.rem[i])))
                    : master32[i];
    const float grad = bf16_to_f32(s.g[i]) * h.mul;
    float m, v;
    if (INT8) {
      m = static_cast<float>(s.mq[i]) * msc;
      v = static_cast<float>(s.vq[i]) * vsc;
      v = v > vsc / 2.0f ? v : vsc / 2.0f;  // the bottom bucket decodes to its top
      v = v * v;
    } else {
      m = bf16_to_f32(s.m16[i]);
      v = bf16_to_f32(s.v16[i]);
    }
    p = p * decay;
    m = m + c1 * (grad - m);
    v = v * h.b2 + c2 * grad * grad;
    p = p - step_size * m / (std::sqrt(v) / h.bc2_sqrt + h.eps);
    if (INT8) {
      mbr[i - a] = m;
      vbr[i - a] = v;
    } else {
      s.m16[i] = f32_to_bf16(m);
      s.v16[i] = f32_to_bf16(v);
    }
    const uint16_t top = f32_to_bf16(p);
    if (SPLIT) {
      const int32_t r = static_cast<int32_t>(bits(p) - (static_cast<uint32_t>(top) << 16));
      s.rem[i] = static_cast<int16_t>(r > 32767 ? 32767 : (r < -32768 ? -32768 : r));
    } else {
      master32[i] = p;
    }
    s.w[i] = top;
  }
}

// [a, b) split where the weight decay stops at d
template <bool SPLIT, bool INT8>
inline void step_span(const State& s, const Hyper& h, int64_t a, int64_t b, int64_t d,
                      float msc, float vsc, float* mb, float* vb) {
  const int64_t c = d < a ? a : (d > b ? b : d);
  if (c > a) step_range<SPLIT, INT8>(s, h, a, c, 1.0f - h.lr * h.wd, msc, vsc, mb, vb);
  if (b > c) step_range<SPLIT, INT8>(s, h, c, b, 1.0f, msc, vsc, mb + (c - a), vb + (c - a));
}

template <bool SPLIT>
void run_bf16(const State& s, const Hyper& h, int64_t lo, int64_t hi, int64_t d) {
  step_span<SPLIT, false>(s, h, lo, hi, d, 0.0f, 0.0f, nullptr, nullptr);
}

template <bool SPLIT>
void run_int8(const State& s, const Hyper& h, int64_t lo, int64_t hi, int64_t d) {
  float mb[BLOCK], vb[BLOCK];  // one block's new moments, before encoding
  for (int64_t b0 = lo; b0 < hi; b0 += BLOCK) {
    const int64_t b1 = b0 + BLOCK < hi ? b0 + BLOCK : hi, n = b1 - b0, blk = b0 / BLOCK;
    step_span<SPLIT, true>(s, h, b0, b1, d, s.ms[blk], s.vs[blk], mb, vb);
    // the block's scales from its new values, then the quantised values. The maxima over
    // non-negative floats as integers (the same order; an integer max vectorizes)
    uint32_t mbits = 0, rbits = 0;
    for (int64_t k = 0; k < n; ++k) {
      const uint32_t a = bits(mb[k]) & 0x7FFFFFFFu;
      mbits = a > mbits ? a : mbits;
      vb[k] = std::sqrt(vb[k]);
      const uint32_t r = bits(vb[k]);
      rbits = r > rbits ? r : rbits;
    }
    const float mmax = from_bits(mbits), rmax = from_bits(rbits);
    const float minv = mmax > 0.0f ? 127.0f / mmax : 0.0f;
    const float vinv = rmax > 0.0f ? 255.0f / rmax : 0.0f;
    int8_t* mq = s.mq + b0;  // (through int32: the compiler vectorizes float -> int32)
    uint8_t* vq = s.vq + b0;
    for (int64_t k = 0; k < n; ++k) {
      mq[k] = static_cast<int8_t>(static_cast<int32_t>(std::rint(mb[k] * minv)));
      vq[k] = static_cast<uint8_t>(static_cast<int32_t>(std::rint(vb[k] * vinv)));
    }
    s.ms[blk] = mmax / 127.0f;
    s.vs[blk] = rmax / 255.0f;
  }
}

}  // namespace

// split: the master is w + rem (else master32, and w receives its bf16 cast); int8: the moments
// are mq + ms, vq + vs (else m16, v16). lo is a multiple of BLOCK (int8 blocks are never split
// between calls); elements before d take the weight decay. w may alias g: each element's
// gradient is read before its weight is written.
extern "C" void fitgpt_adamw(int64_t lo, int64_t hi, int64_t d, int split, int int8,
                             uint16_t* w, int16_t* rem, float* master32, const uint16_t* g,
                             uint16_t* m16, int8_t* mq, float* ms, uint16_t* v16, uint8_t* vq,
                             float* vs, const float* hp) {
  const Hyper h{hp[0], hp[1], hp[2], hp[3], hp[4], hp[5], hp[6], hp[7]};
  const State s{w, rem, master32, g, m16, mq, ms, v16, vq, vs};
  if (int8) {
    split ? run_int8<true>(s, h, lo, hi, d) : run_int8<false>(s, h, lo, hi, d);
  } else {
    split ? run_bf16<true>(s, h, lo, hi, d) : run_bf16<false>(s, h, lo, hi, d);
  }
}

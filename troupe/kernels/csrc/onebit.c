/* Fused CPU loops for 1-bit compression; each makes one pass over its data.
 * Signs are packed most significant bit first; a set bit is +1; sign(0) counts as +1. */
#include <stdint.h>
#include <math.h>
#include <string.h>

#define LANES 16

/* Sum of squares in LANES independent double lanes per block, blocks summed in double: a
 * float's square is exact in double, so the sum differs from any other order's (a GPU's
 * reduction) by a few double roundings, far below what the float scale made from it keeps. */
static double sumsq_block(const float *v, int64_t len) {
    double acc[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= len; i += LANES)
        for (int k = 0; k < LANES; ++k) acc[k] += (double)v[i + k] * v[i + k];
    double total = 0.0;
    for (int k = 0; k < LANES; ++k) total += acc[k];
    for (; i < len; ++i) total += (double)v[i] * v[i];
    return total;
}

/* e[i] += x[i] for i < n; returns the sum of squares of e[0..N), N >= n. */
double onebit_accumulate(float *e, const float *x, int64_t n, int64_t N) {
    const int64_t block = 4096;
    double total = 0.0;
    for (int64_t start = 0; start < N; start += block) {
        int64_t len = N - start < block ? N - start : block;
        int64_t add = n - start < len ? (n - start > 0 ? n - start : 0) : len;
        float *v = e + start;
        for (int64_t i = 0; i < add; ++i) v[i] += x[start + i];
        total += sumsq_block(v, len);
    }
    return total;
}

/* packed[i/8] holds the signs of e; then e[i] -= scale * sign(e[i]). N % 8 == 0. */
void onebit_pack_update(float *e, uint8_t *packed, int64_t N, float scale) {
    for (int64_t b = 0; b < N / 8; ++b) {
        float *v = e + 8 * b;
        uint8_t byte = 0;
        for (int k = 0; k < 8; ++k) {
            int pos = v[k] >= 0.0f;
            byte |= (uint8_t)(pos << (7 - k));
            v[k] = pos ? v[k] - scale : v[k] + scale;
        }
        packed[b] = byte;
    }
}

/* table[b][k]: +v where bit k of byte b (most significant first) is set, else -v */
static void sign_table(float table[256][8], float v) {
    for (int b = 0; b < 256; ++b)
        for (int k = 0; k < 8; ++k) table[b][k] = (b >> (7 - k)) & 1 ? v : -v;
}

/* out[i] (+)= scale * sign_i for the n signs in packed, through a 256 x 8 table of +-scale. */
void onebit_unpack(const uint8_t *packed, float *out, int64_t n, float scale, int accumulate) {
    float table[256][8];
    sign_table(table, scale);
    int64_t full = n / 8;
    if (accumulate) {
        for (int64_t b = 0; b < full; ++b)
            for (int k = 0; k < 8; ++k) out[8 * b + k] += table[packed[b]][k];
    } else {
        for (int64_t b = 0; b < full; ++b) memcpy(out + 8 * b, table[packed[b]], sizeof table[0]);
    }
    for (int64_t i = 8 * full; i < n; ++i) {
        float v = table[packed[full]][i - 8 * full];
        out[i] = accumulate ? out[i] + v : v;
    }
}

/* The fused steps of the 1-bit optimizers' compressed phase, over one piece of a chunk whose
 * momentum is kept packed (its signs start at bit 0 of packed[0]). Each operation is rounded
 * on its own, in the order written, as the torch path does it (the library is built with
 * -ffp-contract=off): the two agree bit for bit. The buffers never overlap (restrict: what
 * lets the loops vectorize). */

/* e[i] += (sign_i * coef) + x[i] * c: the momentum step m = b1 * m_prev + (1 - b1) * g folded
 * into the error buffer it is compressed from, m_prev = sign * coef / b1 never formed. Eight
 * elements a byte, each byte's eight signed values from a table: the loop vectorizes. */
void onebit_momentum(float *restrict e, const uint8_t *restrict packed,
                     const float *restrict x, int64_t n, float coef, float c) {
    float table[256][8];
    sign_table(table, coef);
    int64_t full = n / 8;
    for (int64_t b = 0; b < full; ++b) {
        const float *s = table[packed[b]];
        float *eb = e + 8 * b;
        const float *xb = x + 8 * b;
        for (int k = 0; k < 8; ++k) eb[k] += s[k] + xb[k] * c;
    }
    for (int64_t i = 8 * full; i < n; ++i) e[i] += table[packed[full]][i - 8 * full] + x[i] * c;
}

/* p[i] = p[i] * decay - (sign_i * step) / (sqrt(v[i] * inv_bc2) + eps): Adam's update from
 * the packed momentum (step = lr / bc1 times the chunk's scale) and the frozen variance. */
void onebit_adam_apply(float *restrict p, const float *restrict v,
                       const uint8_t *restrict packed, int64_t n, float step, float decay,
                       float inv_bc2, float eps) {
    float table[256][8];
    sign_table(table, step);
    int64_t full = n / 8;
    for (int64_t b = 0; b < full; ++b) {
        const float *s = table[packed[b]];
        float *pb = p + 8 * b;
        const float *vb = v + 8 * b;
        for (int k = 0; k < 8; ++k) pb[k] = pb[k] * decay - s[k] / (sqrtf(vb[k] * inv_bc2) + eps);
    }
    for (int64_t i = 8 * full; i < n; ++i)
        p[i] = p[i] * decay - table[packed[full]][i - 8 * full] / (sqrtf(v[i] * inv_bc2) + eps);
}

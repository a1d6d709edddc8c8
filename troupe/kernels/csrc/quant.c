/* Weight-only quantized linear layers for a few tokens (decoding): y = x @ dq(W)^T + b, with W
 * held as group-wise INT8 or INT4 (two values a byte, low nibble first) along the input
 * dimension and one fp32 scale per group. Each weight row is dequantized once into a small
 * buffer that stays in L1, then dotted with every token, so the weight is read from memory
 * once, at 0.5 or 1 byte per value, instead of being expanded to a full fp32 matrix first.
 * The loops are written so that the compiler vectorizes them (8 floats a step). */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef float v8 __attribute__((vector_size(32)));

static inline v8 load8(const float *p) {
    v8 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline float hsum(v8 v) {
    return ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
}

/* Dequantize row o of the weight into ``row`` (I floats). */
static void dequant_row(const uint8_t *q, int bits, const float *s, int64_t group, int64_t I,
                        float *row) {
    const int64_t G = I / group;
    for (int64_t g = 0; g < G; g++) {
        const float sg = s[g];
        float *r = row + g * group;
        if (bits == 4) {
            const uint8_t *p = q + g * group / 2;
            for (int64_t j = 0; j < group / 2; j++) {  /* (n ^ 8) - 8 sign-extends a nibble */
                r[2 * j] = (float)(((p[j] & 15) ^ 8) - 8) * sg;
                r[2 * j + 1] = (float)(((p[j] >> 4) ^ 8) - 8) * sg;
            }
        } else {
            const int8_t *p = (const int8_t *)q + g * group;
            for (int64_t j = 0; j < group; j++) r[j] = (float)p[j] * sg;
        }
    }
}

/* x (M, I), q (O, I/2) uint8 for bits 4 or (O, I) int8 for bits 8, scales (O, I/group),
 * bias (O) or NULL, y (M, O); I a multiple of 8 and of group. Returns 0, or -1 if the row
 * buffer cannot be allocated. */
int wq_linear(const float *x, int64_t M, int64_t I, const uint8_t *q, int bits,
              const float *scales, int64_t group, int64_t O, const float *bias, float *y) {
    float *row = malloc(sizeof(float) * (size_t)I);
    if (row == NULL) return -1;
    const int64_t G = I / group, stride = bits == 4 ? I / 2 : I;
    for (int64_t o = 0; o < O; o++) {
        dequant_row(q + o * stride, bits, scales + o * G, group, I, row);
        const float b = bias ? bias[o] : 0.0f;
        int64_t m = 0;
        for (; m + 4 <= M; m += 4) {  /* four tokens share each load of the row */
            const float *x0 = x + m * I, *x1 = x0 + I, *x2 = x1 + I, *x3 = x2 + I;
            v8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
            for (int64_t i = 0; i < I; i += 8) {
                const v8 r = load8(row + i);
                a0 += load8(x0 + i) * r;
                a1 += load8(x1 + i) * r;
                a2 += load8(x2 + i) * r;
                a3 += load8(x3 + i) * r;
            }
            y[m * O + o] = hsum(a0) + b;
            y[(m + 1) * O + o] = hsum(a1) + b;
            y[(m + 2) * O + o] = hsum(a2) + b;
            y[(m + 3) * O + o] = hsum(a3) + b;
        }
        for (; m < M; m++) {
            const float *xm = x + m * I;
            v8 a = {0};
            for (int64_t i = 0; i < I; i += 8) a += load8(xm + i) * load8(row + i);
            y[m * O + o] = hsum(a) + b;
        }
    }
    free(row);
    return 0;
}

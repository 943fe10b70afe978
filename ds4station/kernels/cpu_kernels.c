/* CPU kernels of a CPU stage (kernels/cpu.py compiles this file at first use and loads it with ctypes).

   Quantised matvecs y[m, n] = sum_k W[n, k] x[m, k] over a few activation rows, reading the weights in the
   repacked forms of kernels/{q8_0,iq2_xxs,q2_k,q4_k}.py (each weight byte read once for all rows), and the
   same weights dequantised to fp32 rows (the prefill path multiplies those with BLAS). fp32 math; each
   output is summed by one thread in a fixed order, so results do not depend on the thread count.
   Rows are split over `nt` OpenMP threads (torch's thread count; the process's libgomp: torch's, where torch
   loaded one).

   Grouped projections: weight row n reads x columns (n / rpg) * K .. + K (rpg = rows per group; rpg = N for
   a plain projection). M <= DS4_MAX_ROWS. */

#include <stdint.h>
#include <math.h>
#include <string.h>

#define DS4_MAX_ROWS 8

static inline float h2f(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, bits;
    float out;
    if (exp == 0) {
        out = (float)man * (1.0f / 16777216.0f);  /* zero or subnormal: man * 2^-24 */
        memcpy(&bits, &out, 4);
        bits |= sign;
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (man << 13);
    } else {
        bits = sign | ((exp + 112u) << 23) | (man << 13);
    }
    memcpy(&out, &bits, 4);
    return out;
}

/* Every kernel decodes 32 weights at a time to fp32 values v (the same values as the torch dequantisation),
   then accumulates v * x into 32 lanes per activation row (no horizontal sum inside the K loop): y[m, n] is
   the sum of row m's lanes at the end. */

static inline __attribute__((always_inline)) void rows_fma(float *restrict acc, const float *restrict v, const float *restrict x, int64_t ldx,
                            int64_t M) {
    for (int64_t m = 0; m < M; m++) {
        const float *xm = x + m * ldx;
        float *am = acc + 32 * m;
#pragma omp simd
        for (int j = 0; j < 32; j++) am[j] = fmaf(v[j], xm[j], am[j]);
    }
}

static inline __attribute__((always_inline)) void rows_store(float *y, int64_t ldy, int64_t n, const float *acc, int64_t M) {
    for (int64_t m = 0; m < M; m++) {
        float sum = 0.0f;
        for (int j = 0; j < 32; j++) sum += acc[32 * m + j];
        y[m * ldy + n] = sum;
    }
}

/* One kernel pair per weight type: DECODE(n, b, v) fills v with the 32 values of row n's weights 32 b .. 32 b + 31
   (the type's pointers and K in scope; ARGS names those pointers). The matvec is compiled once per row count
   (1 .. DS4_MAX_ROWS), so that the rows' accumulators stay in registers. */
#define DS4_ROWS_CASE(NAME, C, ...)                                                                                \
    case C:                                                                                                         \
        _Pragma("omp parallel for schedule(static) num_threads(nt)") for (int64_t n = 0; n < N; n++)              \
            NAME##_row(__VA_ARGS__, x + (n / rpg) * K, ldx, y, ldy, n, K, C);                                              \
        break;
#define DS4_KERNELS(NAME, PARAMS, ARGS, DECODE)                                                                    \
    static inline __attribute__((always_inline)) void NAME##_row(PARAMS, const float *xr, int64_t ldx, float *y,   \
                                                                 int64_t ldy, int64_t n, int64_t K, int64_t M) {   \
        float acc[32 * DS4_MAX_ROWS], v[32];                                                                       \
        for (int64_t j = 0; j < 32 * M; j++) acc[j] = 0.0f;                                                        \
        for (int64_t b = 0; b < K / 32; b++) {                                                                     \
            DECODE(n, b, v);                                                                                       \
            rows_fma(acc, v, xr + 32 * b, ldx, M);                                                                 \
        }                                                                                                          \
        rows_store(y, ldy, n, acc, M);                                                                             \
    }                                                                                                              \
    void ds4_##NAME##_matvec(PARAMS, const float *x, int64_t ldx, float *y, int64_t ldy, int64_t N, int64_t K,    \
                             int64_t M, int64_t rpg, int nt) {                                                    \
        switch (M) {                                                                                               \
            DS4_ROWS_CASE(NAME, 1, ARGS) DS4_ROWS_CASE(NAME, 2, ARGS) DS4_ROWS_CASE(NAME, 3, ARGS)                 \
            DS4_ROWS_CASE(NAME, 4, ARGS) DS4_ROWS_CASE(NAME, 5, ARGS) DS4_ROWS_CASE(NAME, 6, ARGS)                 \
            DS4_ROWS_CASE(NAME, 7, ARGS) DS4_ROWS_CASE(NAME, 8, ARGS)                                              \
            default: break;                                                                                        \
        }                                                                                                          \
    }                                                                                                              \
    void ds4_##NAME##_dequant(PARAMS, float *out, int64_t N, int64_t K, int nt) {                                  \
        _Pragma("omp parallel for schedule(static) num_threads(nt)") for (int64_t n = 0; n < N; n++) {            \
            for (int64_t b = 0; b < K / 32; b++) DECODE(n, b, (out + n * K + 32 * b));                             \
        }                                                                                                          \
    }

#define COMMA ,

/* Q8_0: qs int8 [N, K], d fp16 [N, K/32] */
static inline void q8_0_decode(const int8_t *restrict q, float s, float *restrict v) {
    for (int j = 0; j < 32; j++) v[j] = (float)q[j] * s;
}
#define Q8_0_DECODE(n, b, v) q8_0_decode(qs + (n) * K + 32 * (b), h2f(d[(n) * (K / 32) + (b)]), v)
DS4_KERNELS(q8_0, const int8_t *qs COMMA const uint16_t *d, qs COMMA d, Q8_0_DECODE)

/* IQ2_XXS: qs uint32 [N, K/16] (two words per 32 weights), d fp16 [N, K/256]; grid fp32 [256, 8] magnitudes,
   signs fp32 [128, 8] (+-1 of each 7-bit sign field, the 8th by parity).
   value = d * (0.5 + s) / 4 * grid[idx] * sign, as dequantize_iq2_xxs computes it */
static inline void iq2_xxs_decode(const uint32_t *restrict words, const float *restrict grid,
                                  const float *restrict signs, float d, float *restrict v) {
    uint32_t w0 = words[0], w1 = words[1];
    float scale = d * (0.5f + (float)(w1 >> 28)) * 0.25f;
    for (int j = 0; j < 4; j++) {
        const float *g = grid + ((w0 >> (8 * j)) & 255u) * 8, *s = signs + ((w1 >> (7 * j)) & 127u) * 8;
#pragma omp simd
        for (int e = 0; e < 8; e++) v[8 * j + e] = g[e] * s[e] * scale;
    }
}
#define IQ2_XXS_DECODE(n, b, v) \
    iq2_xxs_decode(qs + (n) * (K / 16) + 2 * (b), grid, signs, h2f(d[(n) * (K / 256) + (b) / 8]), v)
DS4_KERNELS(iq2_xxs, const uint32_t *qs COMMA const uint16_t *d COMMA const float *grid COMMA const float *signs,
            qs COMMA d COMMA grid COMMA signs, IQ2_XXS_DECODE)

static inline uint32_t word(const uint8_t *p) {
    uint32_t w;
    memcpy(&w, p, 4);  /* little-endian, as the repacked files are laid out on every supported host */
    return w;
}

/* Q2_K: qs uint8 [N, K/4] (weight 4j + i at bits 2i of byte j: a word holds 16 consecutive weights), sc uint8
   [N, K/16] (scale | min << 4), dm fp16 [N, K/256, 2] (d, dmin). value = d * (sc & 15) * q - dmin * (sc >> 4) */
static inline void q2_k_decode(const uint8_t *restrict q, const uint8_t *restrict sc, const uint16_t *restrict dm,
                               float *restrict v) {
    float d = h2f(dm[0]), dmin = h2f(dm[1]);
    for (int h = 0; h < 2; h++) {
        float dl = d * (float)(sc[h] & 15), ml = dmin * (float)(sc[h] >> 4);
        uint32_t w = word(q + 4 * h);
#pragma omp simd
        for (int t = 0; t < 16; t++) v[16 * h + t] = dl * (float)((w >> (2 * t)) & 3u) - ml;
    }
}
#define Q2_K_DECODE(n, b, v) \
    q2_k_decode(qs + (n) * (K / 4) + 8 * (b), sc + (n) * (K / 16) + 2 * (b), dm + (n) * (K / 128) + 2 * ((b) / 8), v)
DS4_KERNELS(q2_k, const uint8_t *qs COMMA const uint8_t *sc COMMA const uint16_t *dm, qs COMMA sc COMMA dm, Q2_K_DECODE)

/* Q4_K: qs uint8 [N, K/2] (weight 2j low nibble of byte j, 2j + 1 high: a word holds 8 consecutive weights),
   sc / mn uint8 [N, K/32], dm fp16 [N, K/256, 2] (d, dmin). value = d * sc * q - dmin * mn */
static inline void q4_k_decode(const uint8_t *restrict q, float dl, float ml, float *restrict v) {
    for (int u = 0; u < 4; u++) {
        uint32_t w = word(q + 4 * u);
#pragma omp simd
        for (int t = 0; t < 8; t++) v[8 * u + t] = dl * (float)((w >> (4 * t)) & 15u) - ml;
    }
}
#define Q4_K_DECODE(n, b, v)                                                                                       \
    q4_k_decode(qs + (n) * (K / 2) + 16 * (b),                                                                     \
                h2f(dm[(n) * (K / 128) + 2 * ((b) / 8)]) * (float)sc[(n) * (K / 32) + (b)],                        \
                h2f(dm[(n) * (K / 128) + 2 * ((b) / 8) + 1]) * (float)mn[(n) * (K / 32) + (b)], v)
DS4_KERNELS(q4_k, const uint8_t *qs COMMA const uint8_t *sc COMMA const uint8_t *mn COMMA const uint16_t *dm,
            qs COMMA sc COMMA mn COMMA dm, Q4_K_DECODE)

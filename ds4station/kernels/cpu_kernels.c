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

#if defined(__F16C__)
#include <immintrin.h>
static inline float h2f(uint16_t h) { return _cvtsh_ss(h); }  /* exact, subnormals included */
#else
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
#endif

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
/* A switch over the row count M (1 .. DS4_MAX_ROWS), one CASE(NAME, rows, args...) each. */
#define DS4_BY_ROWS(CASE, NAME, ...)                                                                               \
    switch (M) {                                                                                                   \
        CASE(NAME, 1, __VA_ARGS__) CASE(NAME, 2, __VA_ARGS__) CASE(NAME, 3, __VA_ARGS__)                           \
        CASE(NAME, 4, __VA_ARGS__) CASE(NAME, 5, __VA_ARGS__) CASE(NAME, 6, __VA_ARGS__)                           \
        CASE(NAME, 7, __VA_ARGS__) CASE(NAME, 8, __VA_ARGS__)                                                      \
        default: break;                                                                                            \
    }
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
        DS4_BY_ROWS(DS4_ROWS_CASE, NAME, ARGS)                                                                     \
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

/* Integer-dot matvecs of the 2-bit and 4-bit types (x86 with AVX2; AVX-512 VNNI or AVX-VNNI where the CPU has
   it): each activation row is quantised to int8 per 32 values (scale amax / 127, rounded half away from zero: the
   GPU's integer-dot decode kernels' rule, kernels/act_quant.py), and 32 weight codes x 32 activation bytes become
   one exact int32 dot product per block (unsigned codes x signed bytes: vpdpbusd, or vpmaddubsw + vpmaddwd whose
   int16 pair sums cannot saturate at these code ranges). The block's float scale multiplies that sum; a type's
   min term (Q2_K, Q4_K) multiplies the exact fp32 sums of the unquantised activations.
   ds4_int8() says whether this build has them; kernels/cpu.py uses them for decode where it does. */
#if defined(__AVX2__)
#include <immintrin.h>
#include <stdlib.h>

int ds4_int8(void) { return 1; }

static inline __m256i dot_u8s8(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Activation bytes of one 32-block in the order a type's 32 codes come out of its weight bytes:
   0 natural (IQ2_XXS); 1 Q2_K: byte 8 i + j is x[4 j + i] (64-bit lane i of the shifted code word);
   2 Q4_K: bytes 0-15 are x[2 j] (low nibbles), 16-31 x[2 j + 1] (high nibbles). */
static void quant_rows(const float *x, int64_t ldx, int64_t M, int64_t KX, int order, int8_t *q, float *xs,
                       float *xsum) {
    for (int64_t m = 0; m < M; m++) {
        for (int64_t b = 0; b < KX / 32; b++) {
            const float *v = x + m * ldx + 32 * b;
            float amax = 0.0f, s0 = 0.0f, s1 = 0.0f;
            for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(v[j]));
            for (int j = 0; j < 16; j++) s0 += v[j];
            for (int j = 16; j < 32; j++) s1 += v[j];
            float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
            int8_t nat[32], *out = q + m * KX + 32 * b;
            for (int j = 0; j < 32; j++) {
                float t = v[j] * inv;
                nat[j] = (int8_t)(int)(t + (t >= 0.0f ? 0.5f : -0.5f));
            }
            for (int j = 0; j < 32; j++)
                out[j] = order == 0 ? nat[j] : order == 1 ? nat[4 * (j & 7) + (j >> 3)] : nat[2 * (j & 15) + (j >> 4)];
            xs[m * (KX / 32) + b] = amax / 127.0f;
            xsum[m * (KX / 16) + 2 * b] = s0;
            xsum[m * (KX / 16) + 2 * b + 1] = s1;
        }
    }
}

/* One output row n over M activation rows: BLOCK(b) sets `codes` (32 unsigned codes), `wscale` (8 lane scales of
   the block's int32 lanes), may set `signs` (+-1 bytes applied to the activations) and adds the min term into
   `mins[m]`. */
#define DS4_INT8_KERNELS(NAME, PARAMS, ARGS, ORDER, SIGNED, BLOCK)                                                  \
    static inline __attribute__((always_inline)) void NAME##_row_i8(PARAMS, const int8_t *xq, const float *xs,     \
                                                                    const float *xsum, int64_t KX, float *y,      \
                                                                    int64_t ldy, int64_t n, int64_t K, int64_t M) { \
        __m256 acc[DS4_MAX_ROWS];                                                                                  \
        float mins[DS4_MAX_ROWS];                                                                                  \
        for (int64_t m = 0; m < M; m++) acc[m] = _mm256_setzero_ps(), mins[m] = 0.0f;                              \
        for (int64_t b = 0; b < K / 32; b++) {                                                                     \
            __m256i codes, signs = _mm256_setzero_si256();                                                         \
            __m256 wscale;                                                                                         \
            BLOCK(b);                                                                                              \
            for (int64_t m = 0; m < M; m++) {                                                                      \
                __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + m * KX + 32 * b));                          \
                if (SIGNED) xv = _mm256_sign_epi8(xv, signs);                                                      \
                __m256 p = _mm256_cvtepi32_ps(dot_u8s8(codes, xv));                                                \
                acc[m] = _mm256_fmadd_ps(p, _mm256_mul_ps(wscale, _mm256_set1_ps(xs[m * (KX / 32) + b])), acc[m]); \
            }                                                                                                      \
        }                                                                                                          \
        for (int64_t m = 0; m < M; m++) y[m * ldy + n] = hsum8(acc[m]) - mins[m];                                  \
    }                                                                                                              \
    void ds4_##NAME##_matvec_i8(PARAMS, const float *x, int64_t ldx, float *y, int64_t ldy, int64_t N, int64_t K, \
                                int64_t M, int64_t rpg, int nt) {                                                 \
        int64_t KX = (N / rpg) * K;                                                                                \
        int8_t *xq = malloc(M * KX);                                                                               \
        float *xs = malloc(sizeof(float) * M * (KX / 32)), *xsum = malloc(sizeof(float) * M * (KX / 16));          \
        quant_rows(x, ldx, M, KX, ORDER, xq, xs, xsum);                                                            \
        DS4_BY_ROWS(DS4_I8_CASE, NAME, ARGS)                                                                       \
        free(xq), free(xs), free(xsum);                                                                            \
    }
#define DS4_I8_CASE(NAME, C, ...)                                                                                  \
    case C:                                                                                                         \
        _Pragma("omp parallel for schedule(static) num_threads(nt)") for (int64_t n = 0; n < N; n++)              \
            NAME##_row_i8(__VA_ARGS__, xq + (n / rpg) * K, xs + (n / rpg) * (K / 32), xsum + (n / rpg) * (K / 16),   \
                          KX, y, ldy, n, K, C);                                                                    \
        break;

/* IQ2_XXS: grid8 uint64 [256] (the 8 magnitudes of a grid entry as bytes), sign8 uint64 [128] (a 7-bit sign
   field's 8 signs as +-1 bytes, the 8th by parity). */
#define IQ2_XXS_BLOCK(b)                                                                                           \
    {                                                                                                              \
        const uint32_t *wd = qs + n * (K / 16) + 2 * (b);                                                          \
        uint32_t w0 = wd[0], w1 = wd[1];                                                                           \
        codes = _mm256_set_epi64x(grid8[w0 >> 24], grid8[(w0 >> 16) & 255u], grid8[(w0 >> 8) & 255u],             \
                                  grid8[w0 & 255u]);                                                               \
        signs = _mm256_set_epi64x(sign8[(w1 >> 21) & 127u], sign8[(w1 >> 14) & 127u], sign8[(w1 >> 7) & 127u],    \
                                  sign8[w1 & 127u]);                                                               \
        wscale = _mm256_set1_ps(h2f(d[n * (K / 256) + (b) / 8]) * (0.5f + (float)(w1 >> 28)) * 0.25f);             \
    }
DS4_INT8_KERNELS(iq2_xxs, const uint32_t *qs COMMA const uint16_t *d COMMA const uint64_t *grid8 COMMA
                 const uint64_t *sign8, qs COMMA d COMMA grid8 COMMA sign8, 0, 1, IQ2_XXS_BLOCK)

/* Q2_K: the 8 code bytes of a block shifted by 0, 2, 4, 6 in four 64-bit lanes: lane i, byte j is weight 4 j + i;
   int32 lanes 2 i and 2 i + 1 are the block's first and second 16 weights (scales sc[2 b] and sc[2 b + 1]). */
#define Q2_K_BLOCK(b)                                                                                              \
    {                                                                                                              \
        uint64_t c;                                                                                                \
        memcpy(&c, qs + n * (K / 4) + 8 * (b), 8);                                                                 \
        codes = _mm256_and_si256(_mm256_srlv_epi64(_mm256_set1_epi64x((long long)c), _mm256_set_epi64x(6, 4, 2, 0)), \
                                 _mm256_set1_epi8(3));                                                             \
        const uint8_t *s = sc + n * (K / 16) + 2 * (b);                                                            \
        const uint16_t *dd = dm + n * (K / 128) + 2 * ((b) / 8);                                                   \
        float dv = h2f(dd[0]), dmin = h2f(dd[1]), s0 = dv * (float)(s[0] & 15), s1 = dv * (float)(s[1] & 15);     \
        wscale = _mm256_set_ps(s1, s0, s1, s0, s1, s0, s1, s0);                                                    \
        float m0 = dmin * (float)(s[0] >> 4), m1 = dmin * (float)(s[1] >> 4);                                     \
        for (int64_t m = 0; m < M; m++)                                                                            \
            mins[m] += m0 * xsum[m * (KX / 16) + 2 * (b)] + m1 * xsum[m * (KX / 16) + 2 * (b) + 1];                \
    }
DS4_INT8_KERNELS(q2_k, const uint8_t *qs COMMA const uint8_t *sc COMMA const uint16_t *dm, qs COMMA sc COMMA dm, 1, 0,
                 Q2_K_BLOCK)

/* Q4_K: the 16 code bytes' low nibbles (even weights) then high nibbles (odd weights). */
#define Q4_K_BLOCK(b)                                                                                              \
    {                                                                                                              \
        __m128i c = _mm_loadu_si128((const __m128i *)(qs + n * (K / 2) + 16 * (b)));                               \
        codes = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(c, 4), c), _mm256_set1_epi8(15));               \
        const uint16_t *dd = dm + n * (K / 128) + 2 * ((b) / 8);                                                   \
        wscale = _mm256_set1_ps(h2f(dd[0]) * (float)sc[n * (K / 32) + (b)]);                                       \
        float mv = h2f(dd[1]) * (float)mn[n * (K / 32) + (b)];                                                     \
        for (int64_t m = 0; m < M; m++)                                                                            \
            mins[m] += mv * (xsum[m * (KX / 16) + 2 * (b)] + xsum[m * (KX / 16) + 2 * (b) + 1]);                   \
    }
DS4_INT8_KERNELS(q4_k, const uint8_t *qs COMMA const uint8_t *sc COMMA const uint8_t *mn COMMA const uint16_t *dm,
                 qs COMMA sc COMMA mn COMMA dm, 2, 0, Q4_K_BLOCK)
#else
int ds4_int8(void) { return 0; }
#endif

/* specserve's CPU kernels for the decode and verify shapes (a few token rows per forward), built by build.py at run
 * time with the machine's C compiler and called through ctypes (ops.py). Each operation computes a row the same way
 * whatever else is in the batch (no reduction crosses rows), so greedy speculative output stays equal to plain
 * output and a row's logits do not depend on its batch-mates. The products, attention and the layer built of them:
 *
 *   q4_linear  y = x W^T (+ bias) with W in 4-bit groups of 32 along the input: w = code * scale + minimum, the
 *              layout of a GGUF Q4_1 block (code i of a group in byte i's low nibble, code i + 16 in its high one),
 *              fp32 scales and minima, fp32 accumulation; a bf16 model's activations rounded to bf16 first, and
 *              from AMX_MIN_ROWS rows on AMX tiles where the CPU has them (below: their arithmetic, bit for bit).
 *   q8_linear  the same for a GGUF Q8_0 output head (w = code * scale, codes -128..127).
 *   attention  softmax(q k^T * scale) v over the paged KV pool for a group of query rows, each reading the key slots
 *              its mask row allows (causal, windows, chunks and token trees are all just masks), fp32 throughout.
 *   llama_layer / llama_stack  a whole Llama-structured decoder layer (or all of them) in one call.
 *
 * Vector code for AVX-512 (with AVX-512 BF16 and AMX where present) and for AVX2 + FMA (x86-64-v3); elsewhere the
 * plain C loops, which every level computes as written (build.py: -ffp-contract=off).
 *
 * Activations and the KV pool are fp32 or bf16 (dtype code 0 / 1). Threads: OpenMP, which is torch's own runtime
 * (libgomp.so.1, already loaded by torch) so that both share one pool of threads.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define SPECSERVE_AVX512 1
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#define SPECSERVE_AMX 1
#endif
#elif defined(__AVX2__) && defined(__FMA__)
/* x86-64-v3 (AMD Zen 1-3, Intel client parts, many cloud VMs): 8-lane versions of the int4 and Q8_0 products and the
 * exponential; a block of 16 outputs is computed as two halves of 8 lanes in turn (16 ymm registers hold a half's
 * accumulators for 4 rows, not a whole block's) */
#include <immintrin.h>
#define SPECSERVE_AVX2 1
#endif

#define GROUP 32
#define ROW_BLOCK 4
/* Work below this many multiply-adds runs on the calling thread: waking the OpenMP team costs more than it saves,
 * and its threads spin after each region, taking a core from other processes (a server beside its clients). */
#define PARALLEL_WORK (1 << 18)
/* Attention's threshold counts score multiply-adds (n x H x L x D), but each costs several times a product's: the
 * key list, K/V rows converted, exponentials. At PARALLEL_WORK, 4 decode rows of the demo target (9 heads of 64)
 * stayed on one thread below 114 keys (its whole chat) while the other thread spun: 13% of a 4-row step. */
#define ATTENTION_PARALLEL_WORK (1 << 15)

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, as torch's .to(torch.bfloat16) */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static void load_row(const void *src, int dtype, int64_t n, float *dst) {
    if (dtype == 0) {
        memcpy(dst, src, (size_t)n * sizeof(float));
        return;
    }
    const uint16_t *s = (const uint16_t *)src;
    int64_t i = 0;
#ifdef SPECSERVE_AVX512
    for (; i + 16 <= n; i += 16) {
        const __m512i h = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(s + i)));
        _mm512_storeu_ps(dst + i, _mm512_castsi512_ps(_mm512_slli_epi32(h, 16)));
    }
#elif defined(SPECSERVE_AVX2)
    for (; i + 8 <= n; i += 8) {
        const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(s + i)));
        _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(h, 16)));
    }
#endif
    for (; i < n; i++) dst[i] = bf16_to_f32(s[i]);
}

static void store_row(const float *src, int dtype, int64_t n, void *dst) {
    if (dtype == 0) {
        memcpy(dst, src, (size_t)n * sizeof(float));
        return;
    }
    uint16_t *d = (uint16_t *)dst;
    int64_t i = 0;
#ifdef SPECSERVE_AVX512
    for (; i + 16 <= n; i += 16) { /* f32_to_bf16, 16 at a time */
        const __m512i u = _mm512_castps_si512(_mm512_loadu_ps(src + i));
        const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
        __m512i h = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
        const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                      _mm512_set1_epi32(0x7f800000));
        h = _mm512_mask_or_epi32(h, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
        _mm256_storeu_si256((__m256i *)(d + i), _mm512_cvtepi32_epi16(h));
    }
#endif
    for (; i < n; i++) d[i] = f32_to_bf16(src[i]);
}

int specserve_kernels_version(void) { return 10; }

int specserve_kernels_avx512(void) {
#ifdef SPECSERVE_AVX512
    return 1;
#else
    return 0;
#endif
}

/* Weights are stored for this kernel by ops.pack_q4: outputs in blocks of 16 (one AVX-512 lane each), and within a
 * block, for each group and each pair of inputs (k, k + 1), 16 bytes: lane l's code for input k in the low nibble
 * and for input k + 1 in the high one. Scales and minima [N / 16, G, 16]. Each output is then a lane of a vector
 * accumulator (no horizontal sums), and codes unpacked once serve every row of the block of rows. */
static inline __attribute__((always_inline)) void q4_block(const uint8_t *w, const float *scales,
                                                           const float *minima, const float *xs, const float *sums,
                                                           int64_t K, int64_t G, const int rows, float *out,
                                                           int64_t N) {
#ifdef SPECSERVE_AVX512
    __m512 total[ROW_BLOCK];
    for (int r = 0; r < rows; r++) total[r] = _mm512_setzero_ps();
    const __m512i low4 = _mm512_set1_epi32(15);
    for (int64_t g = 0; g < G; g++) {
        __m512 part[ROW_BLOCK][4];
        for (int r = 0; r < rows; r++)
            for (int c = 0; c < 4; c++) part[r][c] = _mm512_setzero_ps();
        const uint8_t *wg = w + g * (GROUP / 2) * 16;
        for (int line = 0; line < 256; line += 64) _mm_prefetch((const char *)wg + 2048 + line, _MM_HINT_T0);
        for (int p = 0; p < GROUP / 2; p += 2) {
            for (int u = 0; u < 2; u++) {
                const __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(wg + (p + u) * 16)));
                const __m512 lo = _mm512_cvtepi32_ps(_mm512_and_si512(c, low4));
                const __m512 hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(c, 4));
                for (int r = 0; r < rows; r++) {
                    const float *x = xs + r * K + g * GROUP + 2 * (p + u);
                    part[r][2 * u] = _mm512_fmadd_ps(lo, _mm512_set1_ps(x[0]), part[r][2 * u]);
                    part[r][2 * u + 1] = _mm512_fmadd_ps(hi, _mm512_set1_ps(x[1]), part[r][2 * u + 1]);
                }
            }
        }
        const __m512 sc = _mm512_loadu_ps(scales + g * 16), mn = _mm512_loadu_ps(minima + g * 16);
        for (int r = 0; r < rows; r++) {
            const __m512 s = _mm512_add_ps(_mm512_add_ps(part[r][0], part[r][1]),
                                           _mm512_add_ps(part[r][2], part[r][3]));
            total[r] = _mm512_fmadd_ps(s, sc, total[r]);
            total[r] = _mm512_fmadd_ps(mn, _mm512_set1_ps(sums[r * G + g]), total[r]);
        }
    }
    for (int r = 0; r < rows; r++) _mm512_storeu_ps(out + r * N, total[r]);
#elif defined(SPECSERVE_AVX2)
    /* per lane two chains (the low nibbles' products, the high ones'), where AVX-512 has four: 4 rows x 3 vectors and
     * the codes fit the 16 registers */
    const __m256i low4 = _mm256_set1_epi32(15);
    for (int half = 0; half < 2; half++) {
        __m256 total[ROW_BLOCK];
        for (int r = 0; r < rows; r++) total[r] = _mm256_setzero_ps();
        for (int64_t g = 0; g < G; g++) {
            __m256 lo_sum[ROW_BLOCK], hi_sum[ROW_BLOCK];
            for (int r = 0; r < rows; r++) lo_sum[r] = hi_sum[r] = _mm256_setzero_ps();
            const uint8_t *wg = w + g * (GROUP / 2) * 16 + 8 * half;
            if (!half)
                for (int line = 0; line < 256; line += 64) _mm_prefetch((const char *)wg + 2048 + line, _MM_HINT_T0);
#pragma GCC unroll 4
            for (int p = 0; p < GROUP / 2; p++) {
                const __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(wg + p * 16)));
                const __m256 lo = _mm256_cvtepi32_ps(_mm256_and_si256(c, low4));
                const __m256 hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(c, 4));
                for (int r = 0; r < rows; r++) {
                    const float *x = xs + r * K + g * GROUP + 2 * p;
                    lo_sum[r] = _mm256_fmadd_ps(lo, _mm256_broadcast_ss(x), lo_sum[r]);
                    hi_sum[r] = _mm256_fmadd_ps(hi, _mm256_broadcast_ss(x + 1), hi_sum[r]);
                }
            }
            const __m256 sc = _mm256_loadu_ps(scales + g * 16 + 8 * half);
            const __m256 mn = _mm256_loadu_ps(minima + g * 16 + 8 * half);
            for (int r = 0; r < rows; r++) {
                total[r] = _mm256_fmadd_ps(_mm256_add_ps(lo_sum[r], hi_sum[r]), sc, total[r]);
                total[r] = _mm256_fmadd_ps(mn, _mm256_broadcast_ss(sums + r * G + g), total[r]);
            }
        }
        for (int r = 0; r < rows; r++) _mm256_storeu_ps(out + r * N + 8 * half, total[r]);
    }
#else
    float total[ROW_BLOCK][16];
    for (int r = 0; r < rows; r++)
        for (int l = 0; l < 16; l++) total[r][l] = 0.0f;
    for (int64_t g = 0; g < G; g++) {
        float part[ROW_BLOCK][4][16];
        for (int r = 0; r < rows; r++)
            for (int c = 0; c < 4; c++)
                for (int l = 0; l < 16; l++) part[r][c][l] = 0.0f;
        const uint8_t *wg = w + g * (GROUP / 2) * 16;
        for (int p = 0; p < GROUP / 2; p += 2)
            for (int u = 0; u < 2; u++)
                for (int r = 0; r < rows; r++) {
                    const float *x = xs + r * K + g * GROUP + 2 * (p + u);
                    for (int l = 0; l < 16; l++) {
                        const uint8_t b = wg[(p + u) * 16 + l];
                        part[r][2 * u][l] += (float)(b & 15) * x[0];
                        part[r][2 * u + 1][l] += (float)(b >> 4) * x[1];
                    }
                }
        for (int r = 0; r < rows; r++)
            for (int l = 0; l < 16; l++) {
                const float s = (part[r][0][l] + part[r][1][l]) + (part[r][2][l] + part[r][3][l]);
                total[r][l] += s * scales[g * 16 + l];
                total[r][l] += minima[g * 16 + l] * sums[r * G + g];
            }
    }
    for (int r = 0; r < rows; r++)
        for (int l = 0; l < 16; l++) out[r * N + l] = total[r][l];
#endif
}

/* Weights of one int4 layer in pack_q4's layout; bias fp32 or NULL. */
typedef struct {
    const uint8_t *codes;
    const float *scales, *minima, *bias;
    int64_t K, N;
} Q4Weights;

/* TEAM marks a function every thread of the calling OpenMP team must call alike (its loops are orphaned `omp for`s,
 * ending in the team's barrier); called outside a parallel region it runs on the calling thread alone. A layer
 * (specserve_llama_layer) is one parallel region: waking the team once per layer rather than once per product, and
 * splitting the row-wise work between the products, which one thread did while the others spun. Scratch: a
 * product's shared buffers for up to R rows of K inputs (scratch_alloc), allocated before the region. */
typedef struct {
    float *xr, *sums; /* [R, K] activations as the product reads them, [R, K / GROUP] their group sums */
    uint16_t *xb;     /* [R, K] the bf16 activations the tiles read */
} Scratch;

static void *scratch_alloc(int64_t R, int64_t K, Scratch *s) {
    float *block = (float *)malloc((size_t)(R * K + R * (K / GROUP) + (R * K + 1) / 2 + 16) * sizeof(float));
    s->xr = block;
    s->sums = block + R * K;
    s->xb = (uint16_t *)(s->sums + R * (K / GROUP));
    return block;
}

#ifdef SPECSERVE_AVX512
static inline __attribute__((always_inline)) void tile_twin_block(const uint8_t *w, const float *scales,
                                                                  const float *minima, const float *xs,
                                                                  const float *sums, int64_t K, int64_t G,
                                                                  const int rows, float *out, int64_t N);
#define Q4_BLOCK(n)                                                                                                    \
    (twin ? tile_twin_block(wb, sc, mn, xr, sr, K, G, n, o, N) : q4_block(wb, sc, mn, xr, sr, K, G, n, o, N))
#else
#define Q4_BLOCK(n) q4_block(wb, sc, mn, xr, sr, K, G, n, o, N)
#endif

/* xs [R, K] fp32 and sums [R, G] (each group's input sum) -> out [R, N] fp32, without the bias: each block of 16
 * outputs by q4_block, or with `twin` (AVX-512 only) by tile_twin_block, the AMX tiles' arithmetic. TEAM. */
static void q4_lanes(const float *xs, const float *sums, int64_t R, const Q4Weights *w, float *out, int twin) {
    const int64_t K = w->K, N = w->N, G = K / GROUP, blocks = N / 16;
    (void)twin;
#pragma omp for schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *wb = w->codes + b * G * (GROUP / 2) * 16;
        const float *sc = w->scales + b * G * 16, *mn = w->minima + b * G * 16;
        for (int64_t r0 = 0; r0 < R; r0 += ROW_BLOCK) {
            const float *xr = xs + r0 * K, *sr = sums + r0 * G;
            float *o = out + r0 * N + b * 16;
            switch (R - r0 < ROW_BLOCK ? (int)(R - r0) : ROW_BLOCK) {
            case 1: Q4_BLOCK(1); break;
            case 2: Q4_BLOCK(2); break;
            case 3: Q4_BLOCK(3); break;
            default: Q4_BLOCK(4); break;
            }
        }
    }
}
#undef Q4_BLOCK

/* TEAM */
static void add_bias(const Q4Weights *w, int64_t R, float *out) {
    if (w->bias)
#pragma omp for schedule(static)
        for (int64_t r = 0; r < R; r++)
            for (int64_t n = 0; n < w->N; n++) out[r * w->N + n] += w->bias[n];
}

/* xs [R, K] fp32 -> out [R, N] fp32 (bias included). TEAM. */
static void q4_matmul(const float *xs, int64_t R, const Q4Weights *w, float *out, const Scratch *scratch) {
    const int64_t K = w->K, G = K / GROUP;
    float *sums = scratch->sums; /* [R, G]: each group's input sum */
#pragma omp for schedule(static)
    for (int64_t r = 0; r < R; r++)
        for (int64_t g = 0; g < G; g++) {
            float s = 0.0f;
            for (int i = 0; i < GROUP; i++) s += xs[r * K + g * GROUP + i];
            sums[r * G + g] = s;
        }
    q4_lanes(xs, sums, R, w, out, 0);
    add_bias(w, R, out);
}

/* ---- int4 products of bf16 activations (a bf16 model's), on AMX tiles for many rows ------------------------------
 * A bf16 model multiplies bf16 activations (as torch's bf16 layers do): round(x) W^T, W = code * scale + minimum per
 * group of 32 inputs. On AMX (Intel Sapphire Rapids and later) one TDPBF16PS multiplies up to 16 rows of a group's 32
 * inputs by its 32 x 16 codes (exact in bf16) in fp32, and the group's scale and minimum are applied after it: the
 * codes are unpacked once per group whatever the number of rows, so 16 rows cost about twice what one does (on the
 * multiply-adds of q4_block each row adds a multiply-add per weight). A tile product has a fixed cost that a few rows
 * do not repay: below AMX_MIN_ROWS rows (and without AMX) q4_tile_twin repeats the tile instruction's arithmetic on
 * AVX-512, bit for bit, so a row's result never depends on the call's width or on the tiles. amx_on: set once per
 * process by specserve_amx (Linux must grant the tile state); fp32 models never round their activations. */
#define AMX_ROWS 16
#define AMX_MIN_ROWS 6
static int amx_on = 0;

int specserve_amx(int want) {
#ifdef SPECSERVE_AMX
    if (want && !amx_on) amx_on = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
#else
    (void)want;
#endif
    if (!want) amx_on = 0;
    return amx_on;
}

int specserve_amx_on(void) { return amx_on; }

int specserve_amx_min_rows(void) { return AMX_MIN_ROWS; }

#ifdef SPECSERVE_AMX
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

/* tiles 0, 1, 6, 7: results (rows x 16 fp32); 2, 3: activations (rows x 32 bf16); 4, 5: codes (16 pairs x 16
 * outputs) */
static void amx_configure(int rows) {
    TileConfig c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) {
        c.colsb[t] = 64;
        c.rows[t] = t == 4 || t == 5 ? 16 : (uint8_t)rows;
    }
    _tile_loadconfig(&c);
}

/* One group's codes of a block (pack_q4's layout) as a B tile: row p holds, for each output n, the words of inputs
 * 2p and 2p + 1 (the low and high nibble of byte p of lane n). A word is the bf16 0x4300 | code = 128 + code
 * (exact): four instructions per row; the 128 x the group's input sum comes off with the minimum (amx_block). */
static inline __attribute__((always_inline)) void amx_codes(const uint8_t *wg, uint16_t *tile) {
    const __m512i nibbles = _mm512_set1_epi32(0x000f000f), base = _mm512_set1_epi32(0x43004300);
    for (int p = 0; p < GROUP / 2; p++) {
        const __m512i t = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(wg + p * 16)));
        const __m512i words = _mm512_or_si512(t, _mm512_slli_epi32(t, 12)); /* low nibble low, high nibble high */
        _mm512_store_si512((void *)(tile + p * 32), _mm512_ternarylogic_epi32(words, nibbles, base, 0xEA));
    }
}

/* group g0 + J's product into result tile TC (activation tile TA, code tile TB) */
#define AMX_DP(TC, TA, TB, J)                                                                                          \
    do {                                                                                                               \
        _tile_loadd(TB, codes[J], 64);                                                                                 \
        _tile_loadd(TA, xb + (g0 + J) * GROUP, K * 2);                                                                 \
        _tile_zero(TC);                                                                                                \
        _tile_dpbf16ps(TC, TA, TB);                                                                                    \
    } while (0)

/* rows (<= 16) rows of xb [., K] bf16 times one block of 16 outputs -> out [rows, N] (this block's 16 columns).
 * The tile unit runs its instructions in order, so four groups' products are issued before the first result is
 * stored: a store waits for its product, and would hold the next group's behind it. */
static inline __attribute__((always_inline)) void amx_block(const uint8_t *wb, const float *scales,
                                                            const float *minima, const uint16_t *xb,
                                                            const float *sums, int64_t K, int64_t G, const int rows,
                                                            float *out, int64_t N) {
    __attribute__((aligned(64))) uint16_t codes[4][GROUP / 2 * 32];
    __attribute__((aligned(64))) float part[4][AMX_ROWS * 16];
    __m512 total[AMX_ROWS];
    for (int r = 0; r < rows; r++) total[r] = _mm512_setzero_ps();
    for (int64_t g0 = 0; g0 < G; g0 += 4) {
        const int n = G - g0 < 4 ? (int)(G - g0) : 4;
        for (int j = 0; j < n; j++) amx_codes(wb + (g0 + j) * (GROUP / 2) * 16, codes[j]);
        AMX_DP(0, 2, 4, 0);
        if (n > 1) AMX_DP(1, 3, 5, 1);
        if (n > 2) AMX_DP(6, 2, 4, 2);
        if (n > 3) AMX_DP(7, 3, 5, 3);
        _tile_stored(0, part[0], 64);
        if (n > 1) _tile_stored(1, part[1], 64);
        if (n > 2) _tile_stored(6, part[2], 64);
        if (n > 3) _tile_stored(7, part[3], 64);
        for (int j = 0; j < n; j++) {
            const int64_t g = g0 + j;
            const __m512 sc = _mm512_loadu_ps(scales + g * 16);
            const __m512 mn = _mm512_fnmadd_ps(_mm512_set1_ps(128.0f), sc, _mm512_loadu_ps(minima + g * 16));
            for (int r = 0; r < rows; r++) {
                total[r] = _mm512_fmadd_ps(_mm512_loadu_ps(part[j] + r * 16), sc, total[r]);
                total[r] = _mm512_fmadd_ps(mn, _mm512_set1_ps(sums[r * G + g]), total[r]);
            }
        }
    }
    for (int r = 0; r < rows; r++) _mm512_storeu_ps(out + r * N, total[r]);
}

/* TEAM */
static void q4_amx(const uint16_t *xb, const float *sums, int64_t R, const Q4Weights *w, float *out) {
    const int64_t K = w->K, N = w->N, G = K / GROUP, blocks = N / 16, chunks = (R + AMX_ROWS - 1) / AMX_ROWS;
    {
        int configured = 0;
#pragma omp for schedule(static)
        for (int64_t item = 0; item < chunks * blocks; item++) {
            const int64_t c = item / blocks, b = item % blocks, r0 = c * AMX_ROWS;
            const int rows = (int)(R - r0 < AMX_ROWS ? R - r0 : AMX_ROWS);
            if (rows != configured) {
                amx_configure(rows);
                configured = rows;
            }
            const uint8_t *wb = w->codes + b * G * (GROUP / 2) * 16;
            const float *sc = w->scales + b * G * 16, *mn = w->minima + b * G * 16, *sr = sums + r0 * G;
            const uint16_t *xr = xb + r0 * K;
            float *o = out + r0 * N + b * 16;
            switch (rows) {
#define AMX_CASE(n) case n: amx_block(wb, sc, mn, xr, sr, K, G, n, o, N); break;
                AMX_CASE(1) AMX_CASE(2) AMX_CASE(3) AMX_CASE(4) AMX_CASE(5) AMX_CASE(6) AMX_CASE(7) AMX_CASE(8)
                AMX_CASE(9) AMX_CASE(10) AMX_CASE(11) AMX_CASE(12) AMX_CASE(13) AMX_CASE(14) AMX_CASE(15)
                default: amx_block(wb, sc, mn, xr, sr, K, G, AMX_ROWS, o, N); break;
#undef AMX_CASE
            }
        }
        if (configured) _tile_release();
    }
}
#endif

/* The tile product's arithmetic without tiles, bit for bit: TDPBF16PS sums a row's even-indexed products of a group
 * in order into one fp32 accumulator and its odd-indexed ones into another, then adds the two (checked against the
 * hardware on 512k random sums: tests/unit/test_cpu_kernel_ops.py checks the kernels agree), so per group
 * part = e + o with e = sum over even k of (128 + code_k) x_k and o over odd k (products exact in fp32), then the
 * scale and minimum as amx_block applies them. Two groups at a time: four accumulator chains a row. */
#ifdef SPECSERVE_AVX512
static inline __attribute__((always_inline)) void tile_twin_block(const uint8_t *w, const float *scales,
                                                                  const float *minima, const float *xs,
                                                                  const float *sums, int64_t K, int64_t G,
                                                                  const int rows, float *out, int64_t N) {
    __m512 total[ROW_BLOCK];
    for (int r = 0; r < rows; r++) total[r] = _mm512_setzero_ps();
    /* 128 + code as fp32 bits: 0x43000000 | code << 16 (the exponent of 128, the code in the mantissa's 2^0 bits) */
    const __m512i nibble = _mm512_set1_epi32(0x000f0000), base = _mm512_set1_epi32(0x43000000);
    for (int64_t g0 = 0; g0 < G; g0 += 2) {
        const int ng = G - g0 < 2 ? 1 : 2;
        __m512 even[2][ROW_BLOCK], odd[2][ROW_BLOCK];
        for (int u = 0; u < 2; u++)
            for (int r = 0; r < rows; r++) even[u][r] = odd[u][r] = _mm512_setzero_ps();
        for (int u = 0; u < ng; u++)
            for (int line = 0; line < 256; line += 64)
                _mm_prefetch((const char *)(w + (g0 + u) * (GROUP / 2) * 16) + 4096 + line, _MM_HINT_T0);
        for (int p = 0; p < GROUP / 2; p++)
            for (int u = 0; u < ng; u++) {
                const int64_t g = g0 + u;
                const uint8_t *bytes = w + g * (GROUP / 2) * 16 + p * 16;
                const __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)bytes));
                const __m512 lo = _mm512_castsi512_ps(
                    _mm512_ternarylogic_epi32(_mm512_slli_epi32(c, 16), nibble, base, 0xEA)); /* (a & b) | c */
                const __m512 hi = _mm512_castsi512_ps(
                    _mm512_ternarylogic_epi32(_mm512_slli_epi32(c, 12), nibble, base, 0xEA));
                for (int r = 0; r < rows; r++) {
                    const float *x = xs + r * K + g * GROUP + 2 * p;
                    even[u][r] = _mm512_fmadd_ps(lo, _mm512_set1_ps(x[0]), even[u][r]);
                    odd[u][r] = _mm512_fmadd_ps(hi, _mm512_set1_ps(x[1]), odd[u][r]);
                }
            }
        for (int u = 0; u < ng; u++) {
            const int64_t g = g0 + u;
            const __m512 sc = _mm512_loadu_ps(scales + g * 16);
            const __m512 mn = _mm512_fnmadd_ps(_mm512_set1_ps(128.0f), sc, _mm512_loadu_ps(minima + g * 16));
            for (int r = 0; r < rows; r++) {
                total[r] = _mm512_fmadd_ps(_mm512_add_ps(even[u][r], odd[u][r]), sc, total[r]);
                total[r] = _mm512_fmadd_ps(mn, _mm512_set1_ps(sums[r * G + g]), total[r]);
            }
        }
    }
    for (int r = 0; r < rows; r++) _mm512_storeu_ps(out + r * N, total[r]);
}
#endif

/* xr [R, K] (bf16-rounded values) and their group sums -> out [R, N], the tile product's arithmetic (no bias).
 * TEAM. */
static void q4_tile_twin(const float *xr, const float *sums, int64_t R, const Q4Weights *w, float *out) {
#ifdef SPECSERVE_AVX512
    q4_lanes(xr, sums, R, w, out, 1);
#else
    const int64_t K = w->K, N = w->N, G = K / GROUP;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < R; r++)
        for (int64_t n = 0; n < N; n++) {
            const int64_t b = n / 16, lane = n % 16;
            float total = 0.0f;
            for (int64_t g = 0; g < G; g++) {
                const uint8_t *wg = w->codes + (b * G + g) * (GROUP / 2) * 16;
                float even = 0.0f, odd = 0.0f;
                for (int p = 0; p < GROUP / 2; p++) {
                    const uint8_t byte = wg[p * 16 + lane];
                    even += (float)(128 + (byte & 15)) * xr[r * K + g * GROUP + 2 * p];
                    odd += (float)(128 + (byte >> 4)) * xr[r * K + g * GROUP + 2 * p + 1];
                }
                const float sc = w->scales[(b * G + g) * 16 + lane];
                total = fmaf(even + odd, sc, total);
                total = fmaf(fmaf(-128.0f, sc, w->minima[(b * G + g) * 16 + lane]), sums[r * G + g], total);
            }
            out[r * N + n] = total;
        }
#endif
}

/* xs [R, K] fp32 -> out [R, N] fp32 = round_bf16(xs) W^T (+ bias): AMX tiles from AMX_MIN_ROWS rows, else their
 * twin. TEAM. */
static void q4_matmul_bf16(const float *xs, int64_t R, const Q4Weights *w, float *out, const Scratch *scratch) {
    const int64_t K = w->K, G = K / GROUP;
    float *xr = scratch->xr, *sums = scratch->sums;
    uint16_t *xb = scratch->xb;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < R; r++)
        for (int64_t g = 0; g < G; g++) {
            const int64_t at = r * K + g * GROUP;
#if defined(__AVX512BF16__)
            __m512 s = _mm512_setzero_ps();
            for (int i = 0; i < GROUP; i += 16) { /* round to nearest even, as f32_to_bf16 */
                __m256i h = (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(xs + at + i));
                /* zero or denormal: zero (keeping the sign), as the tiles read it */
                const __mmask16 tiny = _mm256_testn_epi16_mask(h, _mm256_set1_epi16(0x7f80));
                h = _mm256_mask_mov_epi16(h, tiny, _mm256_and_si256(h, _mm256_set1_epi16((short)0x8000)));
                const __m512 v = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
                _mm256_storeu_si256((__m256i *)(xb + at + i), h);
                _mm512_storeu_ps(xr + at + i, v);
                s = _mm512_add_ps(s, v);
            }
            sums[r * G + g] = _mm512_reduce_add_ps(s);
#else
            float s = 0.0f;
            for (int i = 0; i < GROUP; i++) {
                const uint16_t h = f32_to_bf16(xs[at + i]);
                xb[at + i] = (h & 0x7f80) ? h : (uint16_t)(h & 0x8000); /* denormals as zero, as the tiles read them */
                xr[at + i] = bf16_to_f32(xb[at + i]);
                s += xr[at + i];
            }
            sums[r * G + g] = s;
#endif
        }
#ifdef SPECSERVE_AMX
    if (amx_on && R >= AMX_MIN_ROWS)
        q4_amx(xb, sums, R, w, out);
    else
#endif
        q4_tile_twin(xr, sums, R, w, out);
    add_bias(w, R, out);
}

/* xs [R, K] fp32 -> out [R, N] fp32 = round_bf16(xs) W^T (+ bias) for W [N, K] bf16 row-major (a dense layer of a
 * bf16 model, which multiplies bf16 activations): products exact in fp32, fp32 sums; K a multiple of 32.
 * Q4Weights carries it: codes = W, scales and minima unused. TEAM. */
static void bf16_matmul(const float *xs, int64_t R, const Q4Weights *w, float *out, const Scratch *scratch) {
    const int64_t K = w->K, N = w->N;
    const uint16_t *W = (const uint16_t *)w->codes;
    uint16_t *xb = scratch->xb;
#pragma omp for schedule(static)
    for (int64_t i = 0; i < R * K; i++) xb[i] = f32_to_bf16(xs[i]);
#pragma omp for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const uint16_t *wn = W + n * K;
        for (int64_t r0 = 0; r0 < R; r0 += ROW_BLOCK) {
            const int rows = (int)(R - r0 < ROW_BLOCK ? R - r0 : ROW_BLOCK);
            float acc[ROW_BLOCK] = {0.0f, 0.0f, 0.0f, 0.0f};
#if defined(__AVX512BF16__)
            __m512 v[ROW_BLOCK];
            for (int r = 0; r < rows; r++) v[r] = _mm512_setzero_ps();
            for (int64_t k = 0; k < K; k += 32) {
                const __m512bh wk = (__m512bh)_mm512_loadu_si512((const void *)(wn + k));
                for (int r = 0; r < rows; r++)
                    v[r] = _mm512_dpbf16_ps(v[r], wk, (__m512bh)_mm512_loadu_si512((const void *)(xb + (r0 + r) * K + k)));
            }
            for (int r = 0; r < rows; r++) acc[r] = _mm512_reduce_add_ps(v[r]);
#else
            for (int r = 0; r < rows; r++) {
                const uint16_t *xr = xb + (r0 + r) * K;
                float s = 0.0f;
                for (int64_t k = 0; k < K; k++) s += bf16_to_f32(wn[k]) * bf16_to_f32(xr[k]);
                acc[r] = s;
            }
#endif
            for (int r = 0; r < rows; r++) out[(r0 + r) * N + n] = acc[r] + (w->bias ? w->bias[n] : 0.0f);
        }
    }
}

/* an int4 product for a model whose activations are `dtype` (0 fp32, 1 bf16). TEAM. */
static void q4_product(int dtype, const float *xs, int64_t R, const Q4Weights *w, float *out,
                       const Scratch *scratch) {
    if (dtype == 1)
        q4_matmul_bf16(xs, R, w, out, scratch);
    else
        q4_matmul(xs, R, w, out, scratch);
}

/* the layer's products: int4 (kind 0) or dense bf16 (kind 1), for a model of activations `dtype`. TEAM. */
static void linear(int kind, int dtype, const float *xs, int64_t R, const Q4Weights *w, float *out,
                   const Scratch *scratch) {
    if (kind == 1)
        bf16_matmul(xs, R, w, out, scratch);
    else
        q4_product(dtype, xs, R, w, out, scratch);
}

/* x [R, K] (dtype), codes [N / 16, G, 16, 16] (ops.pack_q4), scales and minima [N / 16, G, 16] fp32, bias [N] fp32
 * or NULL -> y [R, N] (dtype). N a multiple of 16, K of 32. bf16 x: q4_matmul_bf16. */
void specserve_q4_linear(const void *x, int dtype, int64_t R, int64_t K, const uint8_t *codes, const float *scales,
                         const float *minima, const float *bias, int64_t N, void *y) {
    const Q4Weights w = {codes, scales, minima, bias, K, N};
    float *xs = (float *)malloc((size_t)(R * K + R * N) * sizeof(float));
    float *out = xs + R * K;
    Scratch scratch;
    void *block = scratch_alloc(R, K, &scratch);
    for (int64_t r = 0; r < R; r++) load_row((const char *)x + r * K * (dtype ? 2 : 4), dtype, K, xs + r * K);
#pragma omp parallel if (R * N * K >= PARALLEL_WORK)
    q4_product(dtype, xs, R, &w, out, &scratch);
    for (int64_t r = 0; r < R; r++) store_row(out + r * N, dtype, N, (char *)y + r * N * (dtype ? 2 : 4));
    free(block);
    free(xs);
}

/* x [R, K] fp32 -> y [R, N] fp32: the product a bf16 model's int4 layer computes (activations rounded to bf16, the
 * tiles or their twin), its output not rounded: for tests and benches, which compare it bit for bit. */
void specserve_q4_linear_bf16(const float *x, int64_t R, int64_t K, const uint8_t *codes, const float *scales,
                              const float *minima, const float *bias, int64_t N, float *y) {
    const Q4Weights w = {codes, scales, minima, bias, K, N};
    Scratch scratch;
    void *block = scratch_alloc(R, K, &scratch);
#pragma omp parallel if (R * N * K >= PARALLEL_WORK)
    q4_matmul_bf16(x, R, &w, y, &scratch);
    free(block);
}

/* x [R, K] (dtype) -> y [R, N] fp32 through bf16_matmul (W [N, K] bf16, bias fp32 or NULL). */
void specserve_bf16_linear(const void *x, int dtype, int64_t R, int64_t K, const uint16_t *W, const float *bias,
                           int64_t N, float *y) {
    const Q4Weights w = {(const uint8_t *)W, NULL, NULL, bias, K, N};
    float *xs = (float *)malloc((size_t)(R * K) * sizeof(float));
    Scratch scratch;
    void *block = scratch_alloc(R, K, &scratch);
    for (int64_t r = 0; r < R; r++) load_row((const char *)x + r * K * (dtype ? 2 : 4), dtype, K, xs + r * K);
#pragma omp parallel if (R * N * K >= PARALLEL_WORK)
    bf16_matmul(xs, R, &w, y, &scratch);
    free(block);
    free(xs);
}

/* An 8-bit linear layer (GGUF Q8_0: w = code * scale, groups of 32 inputs, codes -128..127): codes [N / 16, K, 16]
 * int8 (block of 16 outputs, input, output lane), scales [N / 16, G, 16] fp32. Same blocking as q4_block. */
static inline __attribute__((always_inline)) void q8_block(const int8_t *w, const float *scales, const float *xs,
                                                           int64_t K, int64_t G, const int rows, float *out,
                                                           int64_t N) {
#ifdef SPECSERVE_AVX512
    __m512 total[ROW_BLOCK];
    for (int r = 0; r < rows; r++) total[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        __m512 even[ROW_BLOCK], odd[ROW_BLOCK];
        for (int r = 0; r < rows; r++) even[r] = odd[r] = _mm512_setzero_ps();
        const int8_t *wg = w + g * GROUP * 16;
        const float *xg = xs + g * GROUP;
        for (int line = 0; line < GROUP * 16; line += 64) _mm_prefetch((const char *)wg + 4096 + line, _MM_HINT_T0);
#pragma GCC unroll 16
        for (int k = 0; k < GROUP; k += 2) {
            const __m512 c0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(wg + k * 16))));
            const __m512 c1 =
                _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(wg + k * 16 + 16))));
            for (int r = 0; r < rows; r++) {
                even[r] = _mm512_fmadd_ps(c0, _mm512_set1_ps(xg[r * K + k]), even[r]);
                odd[r] = _mm512_fmadd_ps(c1, _mm512_set1_ps(xg[r * K + k + 1]), odd[r]);
            }
        }
        const __m512 sc = _mm512_loadu_ps(scales + g * 16);
        for (int r = 0; r < rows; r++) total[r] = _mm512_fmadd_ps(_mm512_add_ps(even[r], odd[r]), sc, total[r]);
    }
    for (int r = 0; r < rows; r++) _mm512_storeu_ps(out + r * N, total[r]);
#elif defined(SPECSERVE_AVX2)
    for (int half = 0; half < 2; half++) { /* each lane's arithmetic as AVX-512's, 8 lanes at a time */
        __m256 total[ROW_BLOCK];
        for (int r = 0; r < rows; r++) total[r] = _mm256_setzero_ps();
        for (int64_t g = 0; g < G; g++) {
            __m256 even[ROW_BLOCK], odd[ROW_BLOCK];
            for (int r = 0; r < rows; r++) even[r] = odd[r] = _mm256_setzero_ps();
            const int8_t *wg = w + g * GROUP * 16 + 8 * half;
            const float *xg = xs + g * GROUP;
            if (!half)
                for (int line = 0; line < GROUP * 16; line += 64)
                    _mm_prefetch((const char *)wg + 4096 + line, _MM_HINT_T0);
#pragma GCC unroll 4
            for (int k = 0; k < GROUP; k += 2) {
                const __m256 c0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(wg + k * 16))));
                const __m256 c1 =
                    _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(wg + k * 16 + 16))));
                for (int r = 0; r < rows; r++) {
                    even[r] = _mm256_fmadd_ps(c0, _mm256_broadcast_ss(xg + r * K + k), even[r]);
                    odd[r] = _mm256_fmadd_ps(c1, _mm256_broadcast_ss(xg + r * K + k + 1), odd[r]);
                }
            }
            const __m256 sc = _mm256_loadu_ps(scales + g * 16 + 8 * half);
            for (int r = 0; r < rows; r++) total[r] = _mm256_fmadd_ps(_mm256_add_ps(even[r], odd[r]), sc, total[r]);
        }
        for (int r = 0; r < rows; r++) _mm256_storeu_ps(out + r * N + 8 * half, total[r]);
    }
#else
    float total[ROW_BLOCK][16];
    for (int r = 0; r < rows; r++)
        for (int l = 0; l < 16; l++) total[r][l] = 0.0f;
    for (int64_t g = 0; g < G; g++) {
        float part[ROW_BLOCK][2][16];
        for (int r = 0; r < rows; r++)
            for (int l = 0; l < 16; l++) part[r][0][l] = part[r][1][l] = 0.0f;
        const int8_t *wg = w + g * GROUP * 16;
        for (int k = 0; k < GROUP; k++)
            for (int r = 0; r < rows; r++)
                for (int l = 0; l < 16; l++) part[r][k & 1][l] += (float)wg[k * 16 + l] * xs[r * K + g * GROUP + k];
        for (int r = 0; r < rows; r++)
            for (int l = 0; l < 16; l++) total[r][l] += (part[r][0][l] + part[r][1][l]) * scales[g * 16 + l];
    }
    for (int r = 0; r < rows; r++)
        for (int l = 0; l < 16; l++) out[r * N + l] = total[r][l];
#endif
}

/* x [R, K] (dtype) -> y [R, N] fp32 (logits); codes and scales as q8_block reads them. */
void specserve_q8_linear(const void *x, int dtype, int64_t R, int64_t K, const int8_t *codes, const float *scales,
                         int64_t N, float *y) {
    const int64_t G = K / GROUP, blocks = N / 16;
    float *xs = (float *)malloc((size_t)(R * K) * sizeof(float));
    for (int64_t r = 0; r < R; r++) load_row((const char *)x + r * K * (dtype ? 2 : 4), dtype, K, xs + r * K);
#pragma omp parallel for schedule(static) if (R * N * K >= PARALLEL_WORK)
    for (int64_t b = 0; b < blocks; b++) {
        const int8_t *w = codes + b * K * 16;
        const float *sc = scales + b * G * 16;
        for (int64_t r0 = 0; r0 < R; r0 += ROW_BLOCK) {
            const float *xr = xs + r0 * K;
            float *o = y + r0 * N + b * 16;
            switch (R - r0 < ROW_BLOCK ? (int)(R - r0) : ROW_BLOCK) {
            case 1: q8_block(w, sc, xr, K, G, 1, o, N); break;
            case 2: q8_block(w, sc, xr, K, G, 2, o, N); break;
            case 3: q8_block(w, sc, xr, K, G, 3, o, N); break;
            default: q8_block(w, sc, xr, K, G, 4, o, N); break;
            }
        }
    }
    free(xs);
}

static inline float dot(const float *a, const float *b, int64_t n) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

/* e^x for x <= 0 (softmax after the maximum is subtracted), vectorizable: 2^n * p(r) with x = n ln2 + r,
 * |r| <= ln2 / 2, p a degree-6 Taylor polynomial (relative error < 2e-7); 0 below -87. */
static inline float exp_nonpositive(float x) {
    const float t = x * 1.44269504089f;
    const float n = __builtin_floorf(t + 0.5f);
    const float r = x - n * 0.693145751953125f - n * 1.428606765330187e-06f;
    float p = 1.0f / 720;
    p = p * r + 1.0f / 120;
    p = p * r + 1.0f / 24;
    p = p * r + 1.0f / 6;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const int32_t e = (int32_t)n;
    int32_t bits = (e + 127) << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    return x < -87.0f ? 0.0f : p * scale;
}

#define MAX_GROUP 16

/* A K/V group's scores and weighted values with the row in registers: each pool row is converted once, 16 values
 * at a time, and multiplied into the (up to 4) query heads at hand; value sums stay in registers across keys.
 * D = 64 or 128 on AVX-512 (0 returned otherwise: the caller's loops run). */
#ifdef SPECSERVE_AVX512
#define ATT_HEADS 4
static inline __m512 kv_chunk(const char *row, int kv_dtype, int j) {
    if (kv_dtype)
        return _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)row + j)), 16));
    return _mm512_loadu_ps((const float *)row + 16 * j);
}

static inline __attribute__((always_inline)) void scores_heads(const float *qv, const int NH, const int ND,
                                                               const char *k_head, int64_t row_bytes, int kv_dtype,
                                                               const int64_t *keys, int64_t count, float scale,
                                                               int64_t L, float *scores) {
    __m512 qr[ATT_HEADS][8];
    for (int h = 0; h < NH; h++)
        for (int j = 0; j < ND; j++) qr[h][j] = _mm512_loadu_ps(qv + h * ND * 16 + 16 * j);
    for (int64_t c = 0; c < count; c++) {
        const char *row = k_head + keys[c] * row_bytes;
        __m512 kc[8];
        for (int j = 0; j < ND; j++) kc[j] = kv_chunk(row, kv_dtype, j);
        for (int h = 0; h < NH; h++) {
            __m512 a = _mm512_mul_ps(qr[h][0], kc[0]);
            for (int j = 1; j < ND; j++) a = _mm512_fmadd_ps(qr[h][j], kc[j], a);
            scores[h * L + c] = _mm512_reduce_add_ps(a) * scale;
        }
    }
}

static inline __attribute__((always_inline)) void values_heads(const float *p, const int NH, const int ND,
                                                               const char *v_head, int64_t row_bytes, int kv_dtype,
                                                               const int64_t *keys, int64_t count, int64_t L,
                                                               float *acc) {
    __m512 sum[ATT_HEADS][8];
    for (int h = 0; h < NH; h++)
        for (int j = 0; j < ND; j++) sum[h][j] = _mm512_setzero_ps();
    for (int64_t c = 0; c < count; c++) {
        const char *row = v_head + keys[c] * row_bytes;
        __m512 vc[8];
        for (int j = 0; j < ND; j++) vc[j] = kv_chunk(row, kv_dtype, j);
        for (int h = 0; h < NH; h++) {
            const __m512 w = _mm512_set1_ps(p[h * L + c]);
            for (int j = 0; j < ND; j++) sum[h][j] = _mm512_fmadd_ps(w, vc[j], sum[h][j]);
        }
    }
    for (int h = 0; h < NH; h++)
        for (int j = 0; j < ND; j++) _mm512_storeu_ps(acc + h * ND * 16 + 16 * j, sum[h][j]);
}

#define HEAD_CASES(CALL)                                                                                               \
    switch (nh * 16 + D / 16) {                                                                                        \
    case 16 + 4: CALL(1, 4); break;                                                                                    \
    case 32 + 4: CALL(2, 4); break;                                                                                    \
    case 48 + 4: CALL(3, 4); break;                                                                                    \
    case 64 + 4: CALL(4, 4); break;                                                                                    \
    case 16 + 8: CALL(1, 8); break;                                                                                    \
    case 32 + 8: CALL(2, 8); break;                                                                                    \
    case 48 + 8: CALL(3, 8); break;                                                                                    \
    default: CALL(4, 8); break;                                                                                        \
    }
#endif

#ifdef SPECSERVE_AVX2
/* 8 lanes: a key row is read once for up to 4 query heads (scores: each head's dot product in one chain), and the
 * values once for up to 3 heads per 32 dimensions (12 accumulators in registers); D = 64 or 128 */
static inline __m256 kv_chunk8(const char *row, int kv_dtype, int j) {
    if (kv_dtype)
        return _mm256_castsi256_ps(
            _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)row + j)), 16));
    return _mm256_loadu_ps((const float *)row + 8 * j);
}

static inline float sum8(__m256 v) {
    const __m128 q = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 h = _mm_add_ps(q, _mm_movehl_ps(q, q));
    return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}

static inline __attribute__((always_inline)) void scores_heads8(const float *qv, const int NH, const int ND,
                                                                const char *k_head, int64_t row_bytes, int kv_dtype,
                                                                const int64_t *keys, int64_t count, float scale,
                                                                int64_t L, float *scores) {
    for (int64_t c = 0; c < count; c++) {
        const char *row = k_head + keys[c] * row_bytes;
        __m256 a[4];
        for (int h = 0; h < NH; h++) a[h] = _mm256_setzero_ps();
        for (int j = 0; j < ND; j++) {
            const __m256 k = kv_chunk8(row, kv_dtype, j);
            for (int h = 0; h < NH; h++) a[h] = _mm256_fmadd_ps(_mm256_loadu_ps(qv + h * ND * 8 + 8 * j), k, a[h]);
        }
        for (int h = 0; h < NH; h++) scores[h * L + c] = sum8(a[h]) * scale;
    }
}

static inline __attribute__((always_inline)) void values_heads8(const float *p, const int NH, const int ND,
                                                                const char *v_head, int64_t row_bytes, int kv_dtype,
                                                                const int64_t *keys, int64_t count, int64_t L,
                                                                float *acc) {
    for (int j0 = 0; j0 < ND; j0 += 4) {
        __m256 sum[3][4];
        for (int h = 0; h < NH; h++)
            for (int j = 0; j < 4; j++) sum[h][j] = _mm256_setzero_ps();
        for (int64_t c = 0; c < count; c++) {
            const char *row = v_head + keys[c] * row_bytes;
            for (int j = 0; j < 4; j++) {
                const __m256 v = kv_chunk8(row, kv_dtype, j0 + j);
                for (int h = 0; h < NH; h++)
                    sum[h][j] = _mm256_fmadd_ps(_mm256_broadcast_ss(p + h * L + c), v, sum[h][j]);
            }
        }
        for (int h = 0; h < NH; h++)
            for (int j = 0; j < 4; j++) _mm256_storeu_ps(acc + h * ND * 8 + 8 * (j0 + j), sum[h][j]);
    }
}
#endif

static int group_scores(const float *qv, int64_t group, int64_t D, const char *k_head, int64_t row_bytes,
                        int kv_dtype, const int64_t *keys, int64_t count, float scale, int64_t L, float *scores) {
#ifdef SPECSERVE_AVX512
    if (D != 64 && D != 128) return 0;
    for (int64_t h0 = 0; h0 < group; h0 += ATT_HEADS) {
        const int64_t nh = group - h0 < ATT_HEADS ? group - h0 : ATT_HEADS;
#define SCORES(NH, ND) \
    scores_heads(qv + h0 * D, NH, ND, k_head, row_bytes, kv_dtype, keys, count, scale, L, scores + h0 * L)
        HEAD_CASES(SCORES)
#undef SCORES
    }
    return 1;
#elif defined(SPECSERVE_AVX2)
    if (D != 64 && D != 128) return 0;
    for (int64_t h0 = 0; h0 < group; h0 += 4) {
        const int64_t nh = group - h0 < 4 ? group - h0 : 4;
#define SCORES8(NH, ND) \
    scores_heads8(qv + h0 * D, NH, ND, k_head, row_bytes, kv_dtype, keys, count, scale, L, scores + h0 * L)
        if (D == 64) {
            if (nh == 1) SCORES8(1, 8); else if (nh == 2) SCORES8(2, 8); else if (nh == 3) SCORES8(3, 8); else SCORES8(4, 8);
        } else {
            if (nh == 1) SCORES8(1, 16); else if (nh == 2) SCORES8(2, 16); else if (nh == 3) SCORES8(3, 16); else SCORES8(4, 16);
        }
#undef SCORES8
    }
    return 1;
#else
    (void)qv, (void)group, (void)D, (void)k_head, (void)row_bytes, (void)kv_dtype, (void)keys, (void)count;
    (void)scale, (void)L, (void)scores;
    return 0;
#endif
}

static int group_values(const float *scores, int64_t group, int64_t D, const char *v_head, int64_t row_bytes,
                        int kv_dtype, const int64_t *keys, int64_t count, int64_t L, float *acc) {
#ifdef SPECSERVE_AVX512
    if (D != 64 && D != 128) return 0;
    for (int64_t h0 = 0; h0 < group; h0 += ATT_HEADS) {
        const int64_t nh = group - h0 < ATT_HEADS ? group - h0 : ATT_HEADS;
#define VALUES(NH, ND) \
    values_heads(scores + h0 * L, NH, ND, v_head, row_bytes, kv_dtype, keys, count, L, acc + h0 * D)
        HEAD_CASES(VALUES)
#undef VALUES
    }
    return 1;
#elif defined(SPECSERVE_AVX2)
    if (D != 64 && D != 128) return 0;
    for (int64_t h0 = 0; h0 < group; h0 += 3) {
        const int64_t nh = group - h0 < 3 ? group - h0 : 3;
#define VALUES8(NH, ND) values_heads8(scores + h0 * L, NH, ND, v_head, row_bytes, kv_dtype, keys, count, L, acc + h0 * D)
        if (D == 64) {
            if (nh == 1) VALUES8(1, 8); else if (nh == 2) VALUES8(2, 8); else VALUES8(3, 8);
        } else {
            if (nh == 1) VALUES8(1, 16); else if (nh == 2) VALUES8(2, 16); else VALUES8(3, 16);
        }
#undef VALUES8
    }
    return 1;
#else
    (void)scores, (void)group, (void)D, (void)v_head, (void)row_bytes, (void)kv_dtype, (void)keys, (void)count;
    (void)L, (void)acc;
    return 0;
#endif
}

/* One query group's attention over the paged pool, rows of q and out at any stride (elements per token row).
 * q [T, ...] (q_dtype), pools [slots, H_kv, D] (kv_dtype), slots [B, L] int64, mask [B, Qmax, L] bool,
 * token_index / output_index [n]: row t of q and out, and its (b, j) = divmod(output_index, Qmax) in the mask.
 * Query heads g * G .. g * G + G - 1 read K/V head g (G = H / H_kv <= 16); each K/V row is converted once for the
 * G heads that read it. TEAM. */
static void attend(const void *q, int q_dtype, int64_t q_stride, int64_t H, int64_t H_kv, int64_t D,
                   const void *k_pool, const void *v_pool, int kv_dtype, const int64_t *slots, const uint8_t *mask,
                   int64_t Qmax, int64_t L, const int64_t *token_index, const int64_t *output_index, int64_t n,
                   float scale, void *out, int out_dtype, int64_t out_stride) {
    const int64_t group = H / H_kv, q_esize = q_dtype ? 2 : 4, out_esize = out_dtype ? 2 : 4;
    const int64_t kv_esize = kv_dtype ? 2 : 4;
    {
        float *buf = (float *)malloc((size_t)(MAX_GROUP * L + 2 * MAX_GROUP * D + D + L) * sizeof(float));
        float *scores = buf, *qv = scores + MAX_GROUP * L, *acc = qv + MAX_GROUP * D, *kv = acc + MAX_GROUP * D;
        int64_t *keys = (int64_t *)malloc((size_t)L * sizeof(int64_t));
#pragma omp for schedule(static)
        for (int64_t item = 0; item < n * H_kv; item++) {
            const int64_t i = item / H_kv, g = item % H_kv, t = token_index[i];
            const int64_t b = output_index[i] / Qmax, j = output_index[i] % Qmax;
            const uint8_t *allowed = mask + (b * Qmax + j) * L;
            int64_t count = 0;
            for (int64_t l = 0; l < L; l++)
                if (allowed[l]) keys[count++] = slots[b * L + l];
            for (int64_t hh = 0; hh < group; hh++)
                load_row((const char *)q + (t * q_stride + (g * group + hh) * D) * q_esize, q_dtype, D, qv + hh * D);
            const char *k_head = (const char *)k_pool + g * D * kv_esize;
            const char *v_head = (const char *)v_pool + g * D * kv_esize;
            const int64_t row_bytes = H_kv * D * kv_esize;
            if (!group_scores(qv, group, D, k_head, row_bytes, kv_dtype, keys, count, scale, L, scores))
                for (int64_t c = 0; c < count; c++) {
                    load_row(k_head + keys[c] * row_bytes, kv_dtype, D, kv);
                    for (int64_t hh = 0; hh < group; hh++) scores[hh * L + c] = dot(qv + hh * D, kv, D) * scale;
                }
            for (int64_t hh = 0; hh < group; hh++) {
                float *sc = scores + hh * L, best = -INFINITY, total = 0.0f;
                for (int64_t c = 0; c < count; c++) best = sc[c] > best ? sc[c] : best;
#pragma omp simd
                for (int64_t c = 0; c < count; c++) sc[c] = exp_nonpositive(sc[c] - best);
                for (int64_t c = 0; c < count; c++) total += sc[c];
                const float inv = total > 0.0f ? 1.0f / total : 0.0f;
#pragma omp simd
                for (int64_t c = 0; c < count; c++) sc[c] *= inv;
                for (int64_t d = 0; d < D; d++) acc[hh * D + d] = 0.0f;
            }
            if (!group_values(scores, group, D, v_head, row_bytes, kv_dtype, keys, count, L, acc))
                for (int64_t c = 0; c < count; c++) {
                    load_row(v_head + keys[c] * row_bytes, kv_dtype, D, kv);
                    for (int64_t hh = 0; hh < group; hh++) {
                        const float p = scores[hh * L + c];
                        float *a = acc + hh * D;
#pragma omp simd
                        for (int64_t d = 0; d < D; d++) a[d] += p * kv[d];
                    }
                }
            for (int64_t hh = 0; hh < group; hh++)
                store_row(acc + hh * D, out_dtype, D,
                          (char *)out + (t * out_stride + (g * group + hh) * D) * out_esize);
        }
        free(keys);
        free(buf);
    }
}

/* q and out [T, H, D] (dtype); the rest as attend. */
void specserve_attention(const void *q, int dtype, int64_t H, int64_t H_kv, int64_t D, const void *k_pool,
                         const void *v_pool, int kv_dtype, const int64_t *slots, const uint8_t *mask, int64_t Qmax,
                         int64_t L, const int64_t *token_index, const int64_t *output_index, int64_t n, float scale,
                         void *out) {
#pragma omp parallel if (n * H_kv >= 2 && n * H * L * D >= ATTENTION_PARALLEL_WORK)
    attend(q, dtype, H * D, H, H_kv, D, k_pool, v_pool, kv_dtype, slots, mask, Qmax, L, token_index, output_index, n,
           scale, out, dtype, H * D);
}

/* ---- one Llama-structured decoder layer in one call (engine/model/fast_layers.py) ----------------------------- */

typedef struct {
    const void *input_norm, *post_norm; /* [H] (dtype) */
    float input_eps, post_eps, scale;
    int32_t dtype, kv_dtype, kind; /* kind: the projections' format (0 int4, 1 dense bf16) */
    int64_t hidden, heads, kv_heads, head_dim, intermediate;
    Q4Weights qkv, o, gate_up, down;
} LayerWeights;

typedef struct { /* one query group of attention_metadata, as attend reads it */
    const int64_t *slots, *token_index, *output_index;
    const uint8_t *mask;
    int64_t qmax, length, n;
} QueryGroupView;

typedef struct {
    int64_t tokens;
    const void *cos, *sin; /* [T, D] (dtype): the model's rotary embedding at each token's position */
    const int64_t *write_slots; /* [T] pool row of each token's K/V */
    int64_t groups;
    QueryGroupView group[2];
} ForwardView;

static void rms_norm(const float *x, const void *weight, int dtype, float eps, int64_t H, float *out) {
    float ss = 0.0f;
    for (int64_t i = 0; i < H; i++) ss += x[i] * x[i];
    const float inv = 1.0f / sqrtf(ss / (float)H + eps);
    for (int64_t i = 0; i < H; i++) {
        const float w = dtype ? bf16_to_f32(((const uint16_t *)weight)[i]) : ((const float *)weight)[i];
        out[i] = x[i] * inv * w;
    }
}

static inline float sigmoid(float x) { /* 1 / (1 + e^-x) from e^-|x| (no overflow) */
    const float z = exp_nonpositive(-fabsf(x));
    return (x >= 0.0f ? 1.0f : z) / (1.0f + z);
}

#ifdef SPECSERVE_AVX512
static inline __m512 exp_nonpositive16(__m512 x) { /* exp_nonpositive, 16 at a time */
    const __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504089f), _mm512_set1_ps(0.5f)),
                                          _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    const __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f),
                                      _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x));
    __m512 p = _mm512_set1_ps(1.0f / 720);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    const __mmask16 tiny = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_LT_OQ);
    return _mm512_maskz_scalef_ps((__mmask16)~tiny, p, n);
}
#elif defined(SPECSERVE_AVX2)
static inline __m256 exp_nonpositive8(__m256 x) { /* exp_nonpositive, 8 at a time */
    const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504089f), _mm256_set1_ps(0.5f)));
    const __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187e-06f),
                                      _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x));
    __m256 p = _mm256_set1_ps(1.0f / 720);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    /* 2^n from its exponent bits; below -87 (n < -125 possible) the lane is 0, as exp_nonpositive's */
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    const __m256 tiny = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_LT_OQ);
    return _mm256_andnot_ps(tiny, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}
#endif

/* out = silu(gate) * up over n values (the down projection's input); relative error < 3e-7 against expf's */
static void silu_mul(const float *gate, const float *up, int64_t n, float *out) {
    int64_t i = 0;
#ifdef SPECSERVE_AVX512
    const __m512 one = _mm512_set1_ps(1.0f);
    for (; i + 16 <= n; i += 16) {
        const __m512 x = _mm512_loadu_ps(gate + i);
        const __m512 z = exp_nonpositive16(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(x)));
        const __mmask16 positive = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_GE_OQ);
        const __m512 s = _mm512_div_ps(_mm512_mask_blend_ps(positive, z, one), _mm512_add_ps(one, z));
        _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_mul_ps(x, s), _mm512_loadu_ps(up + i)));
    }
#elif defined(SPECSERVE_AVX2)
    const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
    for (; i + 8 <= n; i += 8) {
        const __m256 x = _mm256_loadu_ps(gate + i);
        const __m256 z = exp_nonpositive8(_mm256_or_ps(x, sign)); /* -|x| */
        const __m256 positive = _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_GE_OQ);
        const __m256 s = _mm256_div_ps(_mm256_blendv_ps(z, one, positive), _mm256_add_ps(one, z));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_mul_ps(x, s), _mm256_loadu_ps(up + i)));
    }
#endif
    for (; i < n; i++) out[i] = gate[i] * sigmoid(gate[i]) * up[i];
}

/* x [D] in place: x * cos + rotate_half(x) * sin, rotate_half(x) = (-x[D/2:], x[:D/2]) (HF's Llama rotary) */
static void rotate(float *x, const float *cos, const float *sin, int64_t D) {
    const int64_t half = D / 2;
    for (int64_t i = 0; i < half; i++) {
        const float a = x[i], b = x[i + half];
        x[i] = a * cos[i] - b * sin[i];
        x[i + half] = b * cos[i + half] + a * sin[i + half];
    }
}

/* x [T, H] (dtype) -> y [T, H] (dtype): pre-norm attention with rotary embeddings over the paged pool and a SwiGLU
 * MLP, fp32 inside; the layer's K/V rows are written to the pools first. One parallel region (see TEAM): the
 * row-wise steps split by rows, the products by output blocks, attention by (row, K/V head). */
void specserve_llama_layer(const LayerWeights *w, const ForwardView *f, void *k_pool, void *v_pool, const void *x,
                           void *y) {
    const int64_t T = f->tokens, H = w->hidden, D = w->head_dim, I = w->intermediate;
    const int64_t q_width = w->heads * D, kv_width = w->kv_heads * D, qkv_width = q_width + 2 * kv_width;
    const int esize = w->dtype ? 2 : 4, kv_esize = w->kv_dtype ? 2 : 4;
    float *res = (float *)malloc((size_t)(T * (3 * H + qkv_width + q_width + 3 * I)) * sizeof(float));
    float *h = res + T * H, *tmp = h + T * H, *qkv = tmp + T * H, *att = qkv + T * qkv_width;
    float *gu = att + T * q_width, *act = gu + T * 2 * I;
    const int64_t widest = I > H ? (I > q_width ? I : q_width) : (H > q_width ? H : q_width);
    Scratch scratch;
    void *block = scratch_alloc(T, widest, &scratch);
#pragma omp parallel if (T * H * (qkv_width + q_width + 3 * I) >= PARALLEL_WORK)
    {
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; t++) {
            load_row((const char *)x + t * H * esize, w->dtype, H, res + t * H);
            rms_norm(res + t * H, w->input_norm, w->dtype, w->input_eps, H, h + t * H);
        }
        linear(w->kind, w->dtype, h, T, &w->qkv, qkv, &scratch);
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; t++) {
            float *row = qkv + t * qkv_width, trig[2 * 256];
            float *cos = D <= 256 ? trig : (float *)malloc((size_t)(2 * D) * sizeof(float)), *sin = cos + D;
            load_row((const char *)f->cos + t * D * esize, w->dtype, D, cos);
            load_row((const char *)f->sin + t * D * esize, w->dtype, D, sin);
            for (int64_t hd = 0; hd < w->heads + w->kv_heads; hd++) rotate(row + hd * D, cos, sin, D);
            const int64_t slot = f->write_slots[t];
            store_row(row + q_width, w->kv_dtype, kv_width, (char *)k_pool + slot * kv_width * kv_esize);
            store_row(row + q_width + kv_width, w->kv_dtype, kv_width, (char *)v_pool + slot * kv_width * kv_esize);
            if (cos != trig) free(cos);
        }
        for (int64_t g = 0; g < f->groups; g++) {
            const QueryGroupView *v = &f->group[g];
            attend(qkv, 0, qkv_width, w->heads, w->kv_heads, D, k_pool, v_pool, w->kv_dtype, v->slots, v->mask,
                   v->qmax, v->length, v->token_index, v->output_index, v->n, w->scale, att, 0, q_width);
        }
        linear(w->kind, w->dtype, att, T, &w->o, tmp, &scratch);
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; t++) {
            for (int64_t i = 0; i < H; i++) res[t * H + i] += tmp[t * H + i];
            rms_norm(res + t * H, w->post_norm, w->dtype, w->post_eps, H, h + t * H);
        }
        linear(w->kind, w->dtype, h, T, &w->gate_up, gu, &scratch);
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; t++) { /* silu(gate) * up: the down projection's input */
            const float *row = gu + t * 2 * I;
            silu_mul(row, row + I, I, act + t * I);
        }
        linear(w->kind, w->dtype, act, T, &w->down, tmp, &scratch);
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; t++) {
            for (int64_t i = 0; i < H; i++) res[t * H + i] += tmp[t * H + i];
            store_row(res + t * H, w->dtype, H, (char *)y + t * H * esize);
        }
    }
    free(block);
    free(res);
}

/* x [T, H] (dtype) -> y [T, H] (dtype) through n layers in turn (one call for the whole decoder, so the caller
 * releases and takes back the interpreter's lock once per forward, not once per layer): layers[i] with the K/V pools
 * k_pools[i], v_pools[i], all reading the same view. */
void specserve_llama_stack(const LayerWeights *const *layers, int64_t n, const ForwardView *f, void *const *k_pools,
                           void *const *v_pools, const void *x, void *y) {
    const int64_t bytes = f->tokens * layers[0]->hidden * (layers[0]->dtype ? 2 : 4);
    char *between = (char *)malloc((size_t)(2 * bytes));
    for (int64_t i = 0; i < n; i++) {
        const void *in = i == 0 ? x : between + ((i - 1) % 2) * bytes;
        void *out = i == n - 1 ? y : between + (i % 2) * bytes;
        specserve_llama_layer(layers[i], f, k_pools[i], v_pools[i], in, out);
    }
    free(between);
}

/* The structs' sizes as this build lays them out (ops.py's ctypes twins must match): Q4Weights, LayerWeights,
 * QueryGroupView, ForwardView; -1 for another index. */
int64_t specserve_layout(int which) {
    switch (which) {
    case 0: return (int64_t)sizeof(Q4Weights);
    case 1: return (int64_t)sizeof(LayerWeights);
    case 2: return (int64_t)sizeof(QueryGroupView);
    case 3: return (int64_t)sizeof(ForwardView);
    default: return -1;
    }
}

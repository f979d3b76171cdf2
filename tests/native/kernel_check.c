/* The CPU kernels checked from C alone, for a CPU where the Python suite cannot run (aarch64 under qemu-user:
 * tests/unit/test_kernel_check.py builds this file with the kernels for each level and runs it). Includes kernels.c
 * itself; checks the int4 and Q8_0 products and attention against double-precision references built here, and that
 * a row's result is bit for bit the same alone and in a batch. Prints one line per check; exit status 0 iff all
 * pass. */
#include <stdio.h>

#include "../../engine/model/cpu_kernels/kernels.c"

static uint64_t rng = 0x9e3779b97f4a7c15ull;

static uint32_t next_u32(void) { /* xorshift64* */
    rng ^= rng >> 12, rng ^= rng << 25, rng ^= rng >> 27;
    return (uint32_t)((rng * 0x2545f4914f6cdd1dull) >> 32);
}

static float uniform(void) { return (float)next_u32() / 4294967296.0f * 2.0f - 1.0f; }

static int failures = 0;

static void report(const char *what, double err, double tol) {
    const int ok = err <= tol;
    printf("%s %s: max error %.3g (tolerance %.3g)\n", ok ? "ok" : "FAIL", what, err, tol);
    failures += !ok;
}

static void report_equal(const char *what, const float *a, const float *b, size_t n) {
    const int ok = memcmp(a, b, n * sizeof(float)) == 0;
    printf("%s %s\n", ok ? "ok" : "FAIL", what);
    failures += !ok;
}

enum { N = 48, K = 96, R = 7, G = K / GROUP };

static void check_q4(void) {
    static uint8_t codes[N][K], packed[N / 16][G][GROUP / 2][16];
    static float sc[N][G], mn[N][G], psc[N / 16][G][16], pmn[N / 16][G][16], bias[N], x[R][K], y[R][N], one[N];
    for (int n = 0; n < N; n++) {
        bias[n] = uniform();
        for (int k = 0; k < K; k++) codes[n][k] = (uint8_t)(next_u32() % 16);
        for (int g = 0; g < G; g++) sc[n][g] = 0.1f * (uniform() + 1.5f), mn[n][g] = uniform();
    }
    for (int n = 0; n < N; n++) /* ops.pack_q4's layout */
        for (int g = 0; g < G; g++) {
            psc[n / 16][g][n % 16] = sc[n][g], pmn[n / 16][g][n % 16] = mn[n][g];
            for (int p = 0; p < GROUP / 2; p++)
                packed[n / 16][g][p][n % 16] =
                    (uint8_t)(codes[n][g * GROUP + 2 * p] | codes[n][g * GROUP + 2 * p + 1] << 4);
        }
    for (int r = 0; r < R; r++)
        for (int k = 0; k < K; k++) x[r][k] = uniform();
    specserve_q4_linear(x, 0, R, K, &packed[0][0][0][0], &psc[0][0][0], &pmn[0][0][0], bias, N, y);
    double err = 0, scale = 0;
    for (int r = 0; r < R; r++)
        for (int n = 0; n < N; n++) {
            double ref = bias[n];
            for (int k = 0; k < K; k++) ref += (double)x[r][k] * (codes[n][k] * (double)sc[n][k / GROUP] + mn[n][k / GROUP]);
            err = fmax(err, fabs(ref - y[r][n])), scale = fmax(scale, fabs(ref));
        }
    report("q4_linear against the dequantized product", err, 1e-5 * scale);
    for (int r = 0; r < R; r++) {
        specserve_q4_linear(x[r], 0, 1, K, &packed[0][0][0][0], &psc[0][0][0], &pmn[0][0][0], bias, N, one);
        report_equal("q4_linear: a row alone is bit for bit the row in the batch", one, y[r], N);
    }
}

static void check_q8(void) {
    static int8_t codes[N][K], packed[N / 16][K][16];
    static float sc[N][G], psc[N / 16][G][16], x[R][K], y[R][N], one[N];
    for (int n = 0; n < N; n++) {
        for (int k = 0; k < K; k++) codes[n][k] = (int8_t)((int)(next_u32() % 255) - 127);
        for (int g = 0; g < G; g++) sc[n][g] = 0.01f * (uniform() + 1.5f);
    }
    for (int n = 0; n < N; n++) { /* ops.pack_q8's layout */
        for (int k = 0; k < K; k++) packed[n / 16][k][n % 16] = codes[n][k];
        for (int g = 0; g < G; g++) psc[n / 16][g][n % 16] = sc[n][g];
    }
    for (int r = 0; r < R; r++)
        for (int k = 0; k < K; k++) x[r][k] = uniform();
    specserve_q8_linear(x, 0, R, K, &packed[0][0][0], &psc[0][0][0], N, &y[0][0]);
    double err = 0, scale = 0;
    for (int r = 0; r < R; r++)
        for (int n = 0; n < N; n++) {
            double ref = 0;
            for (int k = 0; k < K; k++) ref += (double)x[r][k] * codes[n][k] * sc[n][k / GROUP];
            err = fmax(err, fabs(ref - y[r][n])), scale = fmax(scale, fabs(ref));
        }
    report("q8_linear against the dequantized product", err, 1e-5 * scale);
    for (int r = 0; r < R; r++) {
        specserve_q8_linear(x[r], 0, 1, K, &packed[0][0][0], &psc[0][0][0], N, one);
        report_equal("q8_linear: a row alone is bit for bit the row in the batch", one, y[r], N);
    }
}

static void check_attention(int heads, int kv_heads, int D) {
    enum { B = 2, QMAX = 3, L = 40, SLOTS = 96 };
    const int T = B * QMAX, HD = heads * D, KVD = kv_heads * D, group = heads / kv_heads;
    float *q = malloc(sizeof(float) * T * HD), *out = malloc(sizeof(float) * T * HD);
    float *kp = malloc(sizeof(float) * SLOTS * KVD), *vp = malloc(sizeof(float) * SLOTS * KVD);
    int64_t slots[B * L], index[T];
    uint8_t mask[B * QMAX * L];
    for (int i = 0; i < T * HD; i++) q[i] = uniform();
    for (int i = 0; i < SLOTS * KVD; i++) kp[i] = uniform(), vp[i] = uniform();
    for (int i = 0; i < B * L; i++) slots[i] = (int64_t)(next_u32() % SLOTS);
    for (int i = 0; i < B * QMAX * L; i++) mask[i] = (i % L == 0) || next_u32() % 10 < 6;
    for (int t = 0; t < T; t++) index[t] = t;
    const float scale = 0.25f;
    specserve_attention(q, 0, heads, kv_heads, D, kp, vp, 0, slots, mask, QMAX, L, index, index, T, scale, out);
    double err = 0;
    for (int t = 0; t < T; t++)
        for (int h = 0; h < heads; h++) {
            const int b = t / QMAX, g = h / group;
            double w[L], best = -1e300, total = 0;
            for (int l = 0; l < L; l++) {
                w[l] = -1e300;
                if (!mask[t * L + l]) continue;
                double s = 0;
                for (int d = 0; d < D; d++) s += (double)q[t * HD + h * D + d] * kp[slots[b * L + l] * KVD + g * D + d];
                w[l] = s * scale, best = fmax(best, w[l]);
            }
            for (int l = 0; l < L; l++) total += w[l] > -1e299 ? (w[l] = exp(w[l] - best)) : (w[l] = 0);
            for (int d = 0; d < D; d++) {
                double ref = 0;
                for (int l = 0; l < L; l++) ref += w[l] / total * vp[slots[b * L + l] * KVD + g * D + d];
                err = fmax(err, fabs(ref - out[t * HD + h * D + d]));
            }
        }
    char what[96];
    snprintf(what, sizeof what, "attention (%d heads, %d K/V heads of %d) against masked softmax", heads, kv_heads, D);
    report(what, err, 1e-5);
    free(q), free(out), free(kp), free(vp);
}

int main(void) {
    check_q4();
    check_q8();
    check_attention(6, 2, 16);
    check_attention(9, 3, 64);
    check_attention(14, 2, 128);
    printf("%s: %d failed\n", failures ? "FAIL" : "ok", failures);
    return failures != 0;
}

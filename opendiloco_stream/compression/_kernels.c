/* Native CPU kernels for the block codecs (blockwise.py) and the transport's host copies.
 *
 * Built on first use by native.py (cc -O3 -march=native -ffp-contract=off, no fast-math) and
 * loaded with ctypes; every function is the same arithmetic as the torch code it replaces, in
 * IEEE single precision, so the bytes and values are identical (tests/test_native.py checks it).
 * Functions return 0 on success and 1 when the input holds NaN or Inf.
 *
 * Layout (blockwise.py): blocks of `block` consecutive values, the last one possibly short;
 * 4-bit codes are sign-magnitude nibbles (bit 3 sign), element 2i in the low nibble of byte i.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define TILE 8192 /* values per pass of the 4-bit encoder: its codes stay in L1 before packing */

static inline uint32_t magnitude_bits(float v)
{
    uint32_t u;
    memcpy(&u, &v, sizeof u);
    return u & 0x7fffffffu; /* ordered like |v| for finite v; >= 0x7f800000 for Inf and NaN */
}

/* amax[b] = max |x| over block b (+0 for an all-zero block). */
int ods_block_absmax(const float *x, int64_t n, int64_t block, float *amax)
{
    int bad = 0;
    int64_t n_blocks = (n + block - 1) / block;
    for (int64_t b = 0; b < n_blocks; b++) {
        const float *p = x + b * block;
        int64_t m = (b == n_blocks - 1) ? n - b * block : block;
        uint32_t top = 0;
        for (int64_t i = 0; i < m; i++) {
            uint32_t u = magnitude_bits(p[i]);
            top = u > top ? u : top;
        }
        bad |= top >= 0x7f800000u;
        memcpy(&amax[b], &top, sizeof top);
    }
    return bad;
}

/* 4-bit encode, round to nearest with ties to the smaller magnitude: y = clamp(x / step, -top,
 * top), magnitude = how many of the 7 midpoints between levels lie strictly below |y|, sign =
 * y < 0. A block with step 0 (all zeros) divides by 1. */
void ods_quantize4(const float *x, int64_t n, int64_t block, const float *step, const float *mids,
                   float top, uint8_t *out)
{
    uint8_t codes[TILE];
    const float m0 = mids[0], m1 = mids[1], m2 = mids[2], m3 = mids[3], m4 = mids[4], m5 = mids[5], m6 = mids[6];
    for (int64_t t0 = 0; t0 < n; t0 += TILE) {
        int64_t t1 = n - t0 < TILE ? n : t0 + TILE;
        for (int64_t i = t0; i < t1;) {
            int64_t b = i / block;
            int64_t end = (b + 1) * block < t1 ? (b + 1) * block : t1;
            float s = step[b] > 0.0f ? step[b] : 1.0f;
            for (; i < end; i++) {
                float y = x[i] / s;
                y = y < -top ? -top : y;
                y = y > top ? top : y;
                float a = fabsf(y);
                uint8_t mag = (uint8_t)((a > m0) + (a > m1) + (a > m2) + (a > m3) + (a > m4) + (a > m5) + (a > m6));
                codes[i - t0] = (uint8_t)(mag | ((y < 0.0f) << 3));
            }
        }
        int64_t len = t1 - t0;
        uint8_t *o = out + t0 / 2; /* t0 is a multiple of TILE, which is even */
        for (int64_t k = 0; k < len / 2; k++)
            o[k] = (uint8_t)(codes[2 * k] | (codes[2 * k + 1] << 4));
        if (len & 1)
            o[len / 2] = codes[len - 1]; /* an odd tail leaves the last high nibble zero */
    }
}

/* int8 encode: y = clamp(x / step, -127, 127) rounded half to even (torch.round). */
void ods_quantize_int8(const float *x, int64_t n, int64_t block, const float *step, int8_t *out)
{
    for (int64_t i = 0; i < n;) {
        int64_t b = i / block;
        int64_t end = (b + 1) * block < n ? (b + 1) * block : n;
        float s = step[b] > 0.0f ? step[b] : 1.0f;
        for (; i < end; i++) {
            float y = x[i] / s;
            y = y < -127.0f ? -127.0f : y;
            y = y > 127.0f ? 127.0f : y;
            out[i] = (int8_t)nearbyintf(y);
        }
    }
}

/* 4-bit decode: out[i] = lut[nibble i] * step[block of i] (lut: the 16 signed levels). */
void ods_dequantize4(const uint8_t *codes, int64_t n, int64_t block, const float *step, const float *lut,
                     float *out)
{
    for (int64_t i = 0; i < n;) {
        int64_t b = i / block;
        int64_t end = (b + 1) * block < n ? (b + 1) * block : n;
        float s = step[b];
        if (!(i & 1) && !(end & 1)) { /* whole bytes: two values per code byte */
            for (; i < end; i += 2) {
                uint8_t c = codes[i >> 1];
                out[i] = lut[c & 15] * s;
                out[i + 1] = lut[c >> 4] * s;
            }
        } else {
            for (; i < end; i++)
                out[i] = lut[(codes[i >> 1] >> ((i & 1) * 4)) & 15] * s;
        }
    }
}

/* 8-bit decode (int8, fp8-e4m3): out[i] = lut[code i] * step[block of i] (lut: 256 values).
 * Returns 1 if a code c with (c & mask) == forbidden occurs (no encoder writes it). */
int ods_dequantize8(const uint8_t *codes, int64_t n, int64_t block, const float *step, const float *lut,
                    int mask, int forbidden, float *out)
{
    int bad = 0;
    for (int64_t i = 0; i < n;) {
        int64_t b = i / block;
        int64_t end = (b + 1) * block < n ? (b + 1) * block : n;
        float s = step[b];
        for (; i < end; i++) {
            uint8_t c = codes[i];
            bad |= (c & mask) == forbidden;
            out[i] = lut[c] * s;
        }
    }
    return bad;
}

/* Weighted mean of k fp32 vectors, as reduce.weighted_mean does it in torch: out = v0 * w0, then
 * out = out + vj * wj for each next j (every product and sum rounded on its own), then out / total.
 * Tiles keep `out` in cache across the k passes. */
void ods_weighted_mean(const float *const *values, const float *weights, int k, int64_t n, float total, float *out)
{
    enum { MEAN_TILE = 4096 };
    for (int64_t t0 = 0; t0 < n; t0 += MEAN_TILE) {
        int64_t len = n - t0 < MEAN_TILE ? n - t0 : MEAN_TILE;
        float *o = out + t0;
        const float *v = values[0] + t0;
        float w = weights[0];
        for (int64_t i = 0; i < len; i++)
            o[i] = v[i] * w;
        for (int j = 1; j < k; j++) {
            v = values[j] + t0;
            w = weights[j];
            for (int64_t i = 0; i < len; i++)
                o[i] = o[i] + v[i] * w;
        }
        for (int64_t i = 0; i < len; i++)
            o[i] = o[i] / total;
    }
}

/* Top-k selection of the sparse codecs (sparse.py): per chunk of `block` values (the last one may be
 * short), the in-chunk indices of the k entries of largest magnitude, ties to the lower index, in
 * ascending order -- what a stable descending sort of |x| followed by an ascending sort of the
 * first k picks. out holds k indices per chunk; a short last chunk of m < k values is padded the
 * way the torch code pads it: indices 0..k-1 (its m entries, then padding positions).
 * The k-th largest magnitude is found by radix selection on the bits of |x| (ordered like the
 * values for finite x: the caller checks finiteness first), then one pass in index order keeps
 * everything above it and the first ties. Blocks are at most 4096 values (wire.MAX_BLOCK_SIZE). */
void ods_topk_indices(const float *x, int64_t n, int64_t block, int64_t k, int64_t *out)
{
    uint32_t mag[4096];
    int64_t n_chunks = (n + block - 1) / block;
    for (int64_t c = 0; c < n_chunks; c++) {
        const float *p = x + c * block;
        int64_t m = (c == n_chunks - 1) ? n - c * block : block;
        int64_t *o = out + c * k;
        if (m <= k) {
            for (int64_t j = 0; j < k; j++)
                o[j] = j;
            continue;
        }
        for (int64_t i = 0; i < m; i++)
            mag[i] = magnitude_bits(p[i]);
        uint32_t prefix = 0, mask = 0;
        int64_t remaining = k; /* rank of the threshold among the values matching the prefix */
        for (int shift = 24; shift >= 0; shift -= 8) {
            int64_t hist[256] = {0};
            for (int64_t i = 0; i < m; i++)
                if ((mag[i] & mask) == prefix)
                    hist[(mag[i] >> shift) & 255]++;
            int b = 255;
            for (; b > 0 && hist[b] < remaining; b--)
                remaining -= hist[b];
            prefix |= (uint32_t)b << shift;
            mask |= 255u << shift;
        }
        /* prefix is the k-th largest magnitude; `remaining` of its ties are kept (the first ones) */
        int64_t j = 0;
        for (int64_t i = 0; i < m && j < k; i++) {
            if (mag[i] > prefix || (mag[i] == prefix && remaining-- > 0))
                o[j++] = i;
        }
    }
}

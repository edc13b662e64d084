/* Thin vector layer so that optim_simd.c builds unchanged at 256 bits (AVX2) and 512 bits (AVX-512). */
#ifndef ZK_SIMD_H
#define ZK_SIMD_H

#include <immintrin.h>
#include <stdbool.h>
#include <stdint.h>

#define ZK_INLINE static inline __attribute__((always_inline))
#define ZK_RND (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)

#if ZK_VEC_BITS == 512

#define ZK_W 16			/* floats per vector */
#define ZK_WD 8			/* doubles per vector */
#define ZK_FN(name) name##_avx512
typedef __m512 vf;
typedef __m512d vd;
typedef __m256i vh;		/* ZK_W 16-bit values */
typedef __m512i vi;

ZK_INLINE vf vf_load(const float *p) { return _mm512_loadu_ps(p); }
ZK_INLINE void vf_store(float *p, vf x) { _mm512_storeu_ps(p, x); }
ZK_INLINE void vf_stream(float *p, vf x) { _mm512_stream_ps(p, x); }
ZK_INLINE vf vf_set1(float x) { return _mm512_set1_ps(x); }
ZK_INLINE vf vf_add(vf a, vf b) { return _mm512_add_ps(a, b); }
ZK_INLINE vf vf_sub(vf a, vf b) { return _mm512_sub_ps(a, b); }
ZK_INLINE vf vf_mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
ZK_INLINE vf vf_div(vf a, vf b) { return _mm512_div_ps(a, b); }
ZK_INLINE vf vf_sqrt(vf a) { return _mm512_sqrt_ps(a); }
ZK_INLINE vi vf_bits(vf a) { return _mm512_castps_si512(a); }

/* (d > 0) - (d < 0) as a float, NaN giving 0 like the scalar reference. */
ZK_INLINE vf vf_sign(vf d, vf one)
{
	__mmask16 pos = _mm512_cmp_ps_mask(d, _mm512_setzero_ps(), _CMP_GT_OQ);
	__mmask16 neg = _mm512_cmp_ps_mask(d, _mm512_setzero_ps(), _CMP_LT_OQ);

	return _mm512_sub_ps(_mm512_maskz_mov_ps(pos, one), _mm512_maskz_mov_ps(neg, one));
}

ZK_INLINE vh vh_load(const uint16_t *p) { return _mm256_loadu_si256((const __m256i *)p); }
ZK_INLINE void vh_store(uint16_t *p, vh x) { _mm256_storeu_si256((__m256i *)p, x); }
ZK_INLINE void vh_stream(uint16_t *p, vh x) { _mm256_stream_si256((__m256i *)p, x); }
ZK_INLINE vh vh_from_vf(vf x) { return _mm512_castsi512_si256(_mm512_castps_si512(x)); }

ZK_INLINE vf vf_from_bf16(vh h)
{
	return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

ZK_INLINE vf vf_from_f16(vh h) { return _mm512_cvtph_ps(h); }
ZK_INLINE vh vf_to_f16(vf x) { return _mm512_cvtps_ph(x, ZK_RND); }

/*
 * Integer round-to-nearest-even, not vcvtneps2bf16: that instruction (which
 * needs AVX512_BF16 besides) flushes subnormals, the reference does not.
 */
ZK_INLINE vh vf_to_bf16(vf x)
{
	vi u = _mm512_castps_si512(x);
	vi hi = _mm512_srli_epi32(u, 16);
	vi lsb = _mm512_and_si512(hi, _mm512_set1_epi32(1));
	vi r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
	__mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);

	r = _mm512_mask_or_epi32(r, nan, hi, _mm512_set1_epi32(0x40));
	return _mm512_cvtepi32_epi16(r);
}

ZK_INLINE unsigned vf_count_nonfinite(vf x)
{
	vi e = _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(0x7f800000));

	return (unsigned)__builtin_popcount(_mm512_cmpeq_epi32_mask(e, _mm512_set1_epi32(0x7f800000)));
}

ZK_INLINE vd vd_zero(void) { return _mm512_setzero_pd(); }
ZK_INLINE vd vd_add(vd a, vd b) { return _mm512_add_pd(a, b); }
ZK_INLINE vd vd_mul(vd a, vd b) { return _mm512_mul_pd(a, b); }
ZK_INLINE void vd_store(double *p, vd x) { _mm512_storeu_pd(p, x); }
ZK_INLINE vd vd_from_lo(vf x) { return _mm512_cvtps_pd(_mm512_castps512_ps256(x)); }
ZK_INLINE vd vd_from_hi(vf x) { return _mm512_cvtps_pd(_mm512_extractf32x8_ps(x, 1)); }

#elif ZK_VEC_BITS == 256

#define ZK_W 8
#define ZK_WD 4
#define ZK_FN(name) name##_avx2
typedef __m256 vf;
typedef __m256d vd;
typedef __m128i vh;
typedef __m256i vi;

ZK_INLINE vf vf_load(const float *p) { return _mm256_loadu_ps(p); }
ZK_INLINE void vf_store(float *p, vf x) { _mm256_storeu_ps(p, x); }
ZK_INLINE void vf_stream(float *p, vf x) { _mm256_stream_ps(p, x); }
ZK_INLINE vf vf_set1(float x) { return _mm256_set1_ps(x); }
ZK_INLINE vf vf_add(vf a, vf b) { return _mm256_add_ps(a, b); }
ZK_INLINE vf vf_sub(vf a, vf b) { return _mm256_sub_ps(a, b); }
ZK_INLINE vf vf_mul(vf a, vf b) { return _mm256_mul_ps(a, b); }
ZK_INLINE vf vf_div(vf a, vf b) { return _mm256_div_ps(a, b); }
ZK_INLINE vf vf_sqrt(vf a) { return _mm256_sqrt_ps(a); }
ZK_INLINE vi vf_bits(vf a) { return _mm256_castps_si256(a); }

ZK_INLINE vf vf_sign(vf d, vf one)
{
	vf pos = _mm256_and_ps(_mm256_cmp_ps(d, _mm256_setzero_ps(), _CMP_GT_OQ), one);
	vf neg = _mm256_and_ps(_mm256_cmp_ps(d, _mm256_setzero_ps(), _CMP_LT_OQ), one);

	return _mm256_sub_ps(pos, neg);
}

ZK_INLINE vh vh_load(const uint16_t *p) { return _mm_loadu_si128((const __m128i *)p); }
ZK_INLINE void vh_store(uint16_t *p, vh x) { _mm_storeu_si128((__m128i *)p, x); }
ZK_INLINE void vh_stream(uint16_t *p, vh x) { _mm_stream_si128((__m128i *)p, x); }
ZK_INLINE vh vh_from_vf(vf x) { return _mm256_castsi256_si128(_mm256_castps_si256(x)); }

ZK_INLINE vf vf_from_bf16(vh h)
{
	return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

ZK_INLINE vf vf_from_f16(vh h) { return _mm256_cvtph_ps(h); }
ZK_INLINE vh vf_to_f16(vf x) { return _mm256_cvtps_ph(x, ZK_RND); }

ZK_INLINE vh vf_to_bf16(vf x)
{
	vi u = _mm256_castps_si256(x);
	vi lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
	vi r = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb);
	vi nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
	/* Bytes 2-3 of each dword, i.e. the top half: a shuffle does the >> 16 and the packing. */
	const vi hi16 = _mm256_setr_epi8(2, 3, 6, 7, 10, 11, 14, 15, -1, -1, -1, -1, -1, -1, -1, -1,
	    2, 3, 6, 7, 10, 11, 14, 15, -1, -1, -1, -1, -1, -1, -1, -1);

	/* NaN: no rounding, quiet bit set, as the scalar reference does. */
	r = _mm256_blendv_epi8(r, _mm256_or_si256(u, _mm256_set1_epi32(0x00400000)), nan);
	r = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(r, hi16), 0x08);
	return _mm256_castsi256_si128(r);
}

ZK_INLINE unsigned vf_count_nonfinite(vf x)
{
	vi e = _mm256_and_si256(_mm256_castps_si256(x), _mm256_set1_epi32(0x7f800000));
	vi bad = _mm256_cmpeq_epi32(e, _mm256_set1_epi32(0x7f800000));

	return (unsigned)__builtin_popcount((unsigned)_mm256_movemask_ps(_mm256_castsi256_ps(bad)));
}

ZK_INLINE vd vd_zero(void) { return _mm256_setzero_pd(); }
ZK_INLINE vd vd_add(vd a, vd b) { return _mm256_add_pd(a, b); }
ZK_INLINE vd vd_mul(vd a, vd b) { return _mm256_mul_pd(a, b); }
ZK_INLINE void vd_store(double *p, vd x) { _mm256_storeu_pd(p, x); }
ZK_INLINE vd vd_from_lo(vf x) { return _mm256_cvtps_pd(_mm256_castps256_ps128(x)); }
ZK_INLINE vd vd_from_hi(vf x) { return _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1)); }

#else
#error "ZK_VEC_BITS must be 256 or 512"
#endif

/*
 * Gradients and parameters in the tensor's dtype (enum zk_dtype, from optim.h, which every
 * includer has): widened on load, rounded on store (nt: streaming store past the cache).
 */
ZK_INLINE vf load_grad(const void *g, int dt)
{
	if (dt == ZK_DTYPE_BF16)
		return vf_from_bf16(vh_load(g));
	if (dt == ZK_DTYPE_F16)
		return vf_from_f16(vh_load(g));
	return vf_load(g);
}

ZK_INLINE void store_param(void *p, int dt, vf x, bool nt)
{
	if (dt == ZK_DTYPE_BF16) {
		if (nt)
			vh_stream(p, vf_to_bf16(x));
		else
			vh_store(p, vf_to_bf16(x));
	} else if (dt == ZK_DTYPE_F16) {
		if (nt)
			vh_stream(p, vf_to_f16(x));
		else
			vh_store(p, vf_to_f16(x));
	} else if (dt == ZK_DTYPE_F32) {
		if (nt)
			vf_stream(p, x);
		else
			vf_store(p, x);
	}
}

/* Hides a value from the optimizer: the memory-only kernel must not fold its load/store pairs. */
#define ZK_OPAQUE_V(x) __asm__ volatile("" : "+x"(x))

#endif

// The layout facts the Hopper prefill's scan kernel (src/cuda/chunk_prefill/hopper_scan.cuh)
// relies on, checked on the host against CuTe's own definitions (no GPU needed: these run in CI):
//  * its k and v tiles are read both as [t][c] (K-major, the TMA's and X1's view) and as [c][t]
//    (MN-major: the state update's B, V^T's A): the two views must name the same byte for every
//    element, swizzle included;
//  * an m64nNk16 accumulator's registers, in order, are the k16 A fragments of its columns
//    (acc_to_a): the value i of a thread's accumulator and the value i % 8 of its A fragment of
//    k block i / 8 must be the same element;
//  * the accumulator fragments are compact ((2, 2, N/8), 1, 1), so that flat index i is that
//    value, and the kernel's acc_row / acc_col give its place as CuTe's CLayout does;
//  * the consumers' written-out offsets into the output's TMA-store box are CuTe's swizzled tile.
#include <gtest/gtest.h>

#include <cutlass/numeric_types.h>

#include "cuda/chunk_prefill/hopper_scan.cuh"

namespace {

using namespace cute;
namespace hp = deltastate::cuda_backend::prefill::hopper;

template <class Tile, class TileT, int Cols>
void check_transposed_views() {
  const auto in = Tile{};
  const auto inT = TileT{};
  for (int st = 0; st < hp::kStages; ++st)
    for (int t = 0; t < hp::kC; ++t)
      for (int c = 0; c < Cols; ++c)
        ASSERT_EQ(in(t, c, st), inT(c, t, st)) << "t " << t << " c " << c << " stage " << st;
}

template <class E, int G>
void check_transposed_views() {
  using Lay = hp::ScanLayout<E, G>;
  check_transposed_views<typename Lay::In, typename Lay::InT, hp::kD>();       // q, k
  check_transposed_views<typename Lay::Vt, typename Lay::VtT, Lay::kVCols>();  // v
}

TEST(HopperLayouts, TransposedViewsNameTheSameBytes) {
  check_transposed_views<cutlass::bfloat16_t, 2>();
  check_transposed_views<cutlass::bfloat16_t, 1>();
  check_transposed_views<cutlass::half_t, 2>();
}

// Accumulator value i of thread thr of the MMA's atom against value i % 8 of its k16 A fragment
// of k block i / 8 (the A fragment of the same MMA family: m64 k16).
template <class Mma, int N>
void check_acc_is_a_fragment() {
  using Traits = typename Mma::Atom::Traits;
  const auto c_tv = typename Traits::CLayout{};  // (thr, val) -> m + 64 n
  const auto a_tv = typename Traits::ALayout{};  // (thr, val) -> m + 64 k
  static_assert(decltype(size<1>(c_tv))::value == N / 2, "N / 2 accumulator values a thread");
  for (int thr = 0; thr < 128; ++thr)
    for (int i = 0; i < N / 2; ++i) {
      const int c = c_tv(thr, i), a = a_tv(thr, i % 8);
      ASSERT_EQ(c % 64, a % 64) << "row, thread " << thr << " value " << i;
      ASSERT_EQ(c / 64, a / 64 + 16 * (i / 8)) << "column, thread " << thr << " value " << i;
    }
}

TEST(HopperLayouts, AccumulatorRegistersAreAFragments) {
  using Lay = hp::ScanLayout<cutlass::bfloat16_t, 2>;
  check_acc_is_a_fragment<typename Lay::MmaX, 64>();
  check_acc_is_a_fragment<typename Lay::MmaS, 128>();
  using LayH = hp::ScanLayout<cutlass::half_t, 2>;
  check_acc_is_a_fragment<typename LayH::MmaX, 64>();
  check_acc_is_a_fragment<typename LayH::MmaS, 128>();
}

// The kernel's written-out accumulator coordinates (acc_row, acc_col) are CuTe's CLayout.
template <class Mma, int N>
void check_acc_coordinates() {
  const auto c_tv = typename Mma::Atom::Traits::CLayout{};
  for (int thr = 0; thr < 128; ++thr)
    for (int i = 0; i < N / 2; ++i)
      ASSERT_EQ(c_tv(thr, i), hp::acc_row(thr, i) + 64 * hp::acc_col(thr, i))
          << "thread " << thr << " value " << i;
}

TEST(HopperLayouts, AccumulatorCoordinatesAreCuTes) {
  using Lay = hp::ScanLayout<cutlass::bfloat16_t, 2>;
  check_acc_coordinates<typename Lay::MmaX, 64>();
  check_acc_coordinates<typename Lay::MmaS, 128>();
}

template <class Mma, int N>
void check_compact_fragment() {
  Tensor f = partition_fragment_C(Mma{}, Shape<_64, Int<N>>{});
  static_assert(decltype(size(f))::value == N / 2, "N / 2 accumulators a thread");
  for (int i = 0; i < N / 2; ++i) ASSERT_EQ(f.layout()(i), i);
  ASSERT_EQ(int(size<0>(f)), N / 2);
}

TEST(HopperLayouts, AccumulatorFragmentsAreCompact) {
  using Lay = hp::ScanLayout<cutlass::bfloat16_t, 2>;
  check_compact_fragment<typename Lay::MmaX, 64>();
  check_compact_fragment<typename Lay::MmaS, 128>();
}

// The consumers' writes of o into a group's TMA-store box: out_box_byte is OutTile's byte offset
// for every element, and value i of a thread sits at the base of value i % 4 plus (i / 4) * 1024
// bytes. An smem tile's swizzle acts on the byte address of its unswizzled element (CuTe's
// swizzle_ptr, and the TMA alike), so the reference is the swizzle portion applied to the bytes
// of the non-swizzle portion (evaluating the composed layout applies it to element offsets).
template <class E>
void check_out_box() {
  const auto box = typename hp::ScanLayout<E, 2>::OutTile{};
  const auto swizzle = get_swizzle_portion(box);
  const auto linear = get_nonswizzle_portion(box);
  for (int t = 0; t < hp::kC; ++t)
    for (int v = 0; v < 64; ++v)
      ASSERT_EQ(swizzle(static_cast<int>(linear(t, v)) * static_cast<int>(sizeof(E))),
                hp::out_box_byte(t, v))
          << "t " << t << " v " << v;
  for (int thr = 0; thr < 128; ++thr)
    for (int i = 0; i < 32; ++i)
      ASSERT_EQ(hp::out_box_byte(hp::acc_col(thr, i), hp::acc_row(thr, i)),
                hp::out_box_byte(hp::acc_col(thr, i % 4), hp::acc_row(thr, i % 4)) + (i / 4) * 1024)
          << "thread " << thr << " value " << i;
}

TEST(HopperLayouts, OutputBoxOffsetsAreOutTiles) {
  check_out_box<cutlass::bfloat16_t>();
  check_out_box<cutlass::half_t>();
}

}  // namespace

"""bench.compiled_reads reads inductor's generated CPU code as it is written: a kernel's top-level loop
nests, which [layers, batch, pos, keys] tensors each reads whole or writes, a gather not counted."""

from __future__ import annotations

from bench.compiled_reads import loop_nests, reads

# The shape of inductor's output (torch 2.x, CPU): the kernel, then `call` allocating and passing buffers.
CODE = """
cpp_fused_0 = async_compile.cpp_pybinding(['const float*', 'const int64_t*', 'float*', 'float*'], r'''
extern "C"  void  kernel(const float* in_ptr0,
                       const int64_t* in_ptr1,
                       float* out_ptr0,
                       float* out_ptr1,
                       const int64_t ks0)
{
    {
        for(int64_t x0=static_cast<int64_t>(0L); x0<static_cast<int64_t>(ks0); x0+=static_cast<int64_t>(1L))
        {
            auto tmp0 = in_ptr0[static_cast<int64_t>(x0)];
            out_ptr0[static_cast<int64_t>(x0)] = tmp0;
        }
    }
    {
        for(int64_t x0=static_cast<int64_t>(0L); x0<static_cast<int64_t>(ks0); x0+=static_cast<int64_t>(1L))
        {
            auto tmp0 = in_ptr1[static_cast<int64_t>(x0)];
            auto tmp1 = in_ptr0[static_cast<int64_t>(tmp0 + x0)];
            auto tmp2 = at::vec::Vectorized<float>::loadu(out_ptr0 + static_cast<int64_t>(x0), 16);
            out_ptr1[static_cast<int64_t>(x0)] = tmp1;
        }
    }
}
''')

class Runner:
    def call(self, args):
        arg0_1, arg1_1, arg2_1, arg3_1, arg4_1, arg5_1, arg6_1 = args
        buf0 = empty_strided_cpu((s1, s2, s3, s4), (1, 1, 1, 1), torch.float32)
        buf1 = empty_strided_cpu((s1, s2, s4), (1, 1, 1), torch.float32)
        cpp_fused_0(arg4_1, arg6_1, buf0, buf1, s1)
        return (buf1, )
"""


def test_each_loop_nest_reads_and_writes_the_groups_tensors_whole_a_gather_apart():
    assert loop_nests(CODE) == [{"reads": ["c"], "writes": ["buf0"]}, {"reads": ["buf0"], "writes": []}]
    found = reads(CODE)
    assert (found["nests_reading_c"], found["nests_over_the_group"]) == (1, 2)
    assert found["bytes_a_coefficient"] == 12  # c read, buf0 written and read: float32 each

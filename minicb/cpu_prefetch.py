"""prefetch(array, flat_index): a hint, inside a Numba kernel, that the CPU should start fetching a
cache line now, because the kernel will read it soon.

A CPU's own prefetcher follows runs of memory. A paged KV cache jumps: a sequence's
next block may lie anywhere in the pool, and only the kernel, which reads the block
table, knows where. So minicb/cpu_attention.py asks for a block's value rows while it
scores the block, and for the next block's key rows while it weighs values.
A prefetch never faults and changes no value: it only saves waiting later.

Numba has no prefetch of its own; this is LLVM's `llvm.prefetch` intrinsic, which
compiles to one instruction (PREFETCHT0 on x86, PRFM on ARM). Importing this
module imports Numba. A kernel should reach it as a global of its module, not close
over it, or Numba's disk cache misses in every new process.
"""
from llvmlite import ir
from numba.core import types
from numba.extending import intrinsic


@intrinsic
def prefetch(typingctx, array, flat_index):
    """Fetch array's element flat_index (C order) into every cache level, for reading."""

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        address = builder.bitcast(builder.gep(data, [args[1]]), ir.IntType(8).as_pointer())
        i32 = ir.IntType(32)
        fn = builder.module.declare_intrinsic("llvm.prefetch", [address.type],
                                              ir.FunctionType(ir.VoidType(), [address.type, i32, i32, i32]))
        # llvm.prefetch(address, 0: to read, 3: keep in every cache level, 1: data, not instructions)
        builder.call(fn, [address, ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])
        return context.get_dummy_value()

    return types.void(array, flat_index), codegen

"""Kernels written in LLVM IR and compiled for this machine at first use
(llvmlite, the LLVM binding of the Numba project), called through ctypes,
which releases the GIL: what ``direct`` (convolution) and ``half`` (float16
conversions) share.

Why LLVM IR and not Numba: the kernels need a register tiling and vector
instructions that Numba's loop vectoriser did not find (docs/design/cpu.md);
IR states them, and LLVM still picks the instructions for the host.
"""
import ctypes
import functools
import platform
import threading

# LLVM's context is shared by the process: one compilation at a time (the
# kernels are compiled when first used, which may be on several threads)
_compiling = threading.Lock()


class Builder:
    """Writes a module's functions: shared types and the IR idioms the
    kernels use (a function, a counted loop, a vector load, a broadcast,
    integer minimum and maximum)."""

    def __init__(self, name, lanes):
        import llvmlite.ir as ir
        self.ir = ir
        self.lanes = lanes
        self.f64, self.f32, self.f16 = ir.DoubleType(), ir.FloatType(), ir.HalfType()
        self.i64, self.i32, self.i16 = ir.IntType(64), ir.IntType(32), ir.IntType(16)
        self.vec = ir.VectorType(self.f32, lanes)
        self.fp, self.hp, self.ip = self.f32.as_pointer(), self.f16.as_pointer(), self.i64.as_pointer()
        self.module = ir.Module(name=name)

    def const(self, v):
        return self.ir.Constant(self.i64, v)

    @staticmethod
    def smaller(b, a, c):
        """The smaller of signed integers ``a`` and ``c``."""
        return b.select(b.icmp_signed("<", a, c), a, c)

    @staticmethod
    def larger(b, a, c):
        """The larger of signed integers ``a`` and ``c``."""
        return b.select(b.icmp_signed(">", a, c), a, c)

    def function(self, name, arguments, internal=False):
        """void name(``arguments``: IR types; pointers are noalias), and a
        builder at its entry."""
        ir = self.ir
        fn = ir.Function(self.module, ir.FunctionType(ir.VoidType(), arguments), name=name)
        for a in fn.args:
            if isinstance(a.type, ir.PointerType):
                a.add_attribute("noalias")
        if internal:
            fn.linkage = "internal"
        return fn, ir.IRBuilder(fn.append_basic_block("entry"))

    def vector_at(self, b, base, index, lanes=None):
        """The ``lanes`` (default: the builder's) values of ``base``'s element
        type from base[index] on."""
        vector = self.ir.VectorType(base.type.pointee, lanes or self.lanes)
        return b.load(b.bitcast(b.gep(base, [index]), vector.as_pointer()), align=2)

    def store_vector(self, b, value, base, index):
        b.store(value, b.bitcast(b.gep(base, [index]), value.type.as_pointer()), align=2)

    def spread(self, b, value, lanes=None):
        """``value`` in each of ``lanes`` (default: the builder's) lanes."""
        ir, lanes = self.ir, lanes or self.lanes
        vector = ir.VectorType(value.type, lanes)
        one = b.insert_element(ir.Constant(vector, ir.Undefined), value, ir.Constant(self.i32, 0))
        return b.shuffle_vector(one, ir.Constant(vector, ir.Undefined),
                                ir.Constant(ir.VectorType(self.i32, lanes), [0] * lanes))

    def counted(self, b, n, body, carried=()):
        """for i in range(n): carried = body(i, carried); returns the final
        values of ``carried`` (loop-carried values, kept in registers)."""
        fn, before = b.function, b.block
        head, inside, out = (fn.append_basic_block() for _ in range(3))
        b.branch(head)
        b.position_at_end(head)
        i = b.phi(self.i64)
        i.add_incoming(self.const(0), before)
        phis = [b.phi(v.type) for v in carried]
        for phi, v in zip(phis, carried):
            phi.add_incoming(v, before)
        b.cbranch(b.icmp_signed("<", i, n), inside, out)
        b.position_at_end(inside)
        updated = body(i, phis)
        i.add_incoming(b.add(i, self.const(1)), b.block)
        for phi, v in zip(phis, updated if carried else ()):
            phi.add_incoming(v, b.block)
        b.branch(head)
        b.position_at_end(out)
        return phis


@functools.lru_cache(maxsize=None)
def _native():
    """(llvmlite.binding, the host's CPU features), or None off x86-64 or
    without llvmlite."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return None
    try:
        import llvmlite.binding as llvm
    except ImportError:
        return None
    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    return llvm, llvm.get_host_cpu_features()


def host_features():
    """The host's CPU features ({name: bool}; empty off x86-64 or without
    llvmlite)."""
    native = _native()
    return {} if native is None else dict(native[1])


@functools.lru_cache(maxsize=None)
def has_avx512():
    """Whether the host has AVX-512F (the kernels' wider vectors)."""
    return bool(host_features().get("avx512f"))


def compile_module(ir_text, needs):
    """An execution engine holding ``ir_text`` compiled for this CPU (it
    owns the code: keep it alive while its functions are called), or None
    where x86-64, llvmlite or one of the CPU features ``needs`` is missing.
    Safe to call from several threads."""
    with _compiling:
        return _compile(ir_text, needs)


def compile_functions(ir_text, needs, signatures):
    """{name: ctypes function} for the void functions of ``ir_text`` named
    in ``signatures`` (name: ctypes argument types), compiled as
    :func:`compile_module` does (None where it gives None); each function
    holds the engine that owns its code (``.engine``)."""
    engine = compile_module(ir_text, needs)
    if engine is None:
        return None
    functions = {}
    for name, arguments in signatures.items():
        functions[name] = ctypes.CFUNCTYPE(None, *arguments)(engine.get_function_address(name))
        functions[name].engine = engine
    return functions


def _compile(ir_text, needs):
    native = _native()
    if native is None:
        return None
    llvm, features = native
    if not all(features.get(f) for f in needs):
        return None
    module = llvm.parse_assembly(ir_text)
    module.verify()
    module.triple = llvm.get_process_triple()
    target = llvm.Target.from_triple(module.triple)
    machine = target.create_target_machine(cpu=llvm.get_host_cpu_name(), features=features.flatten(), opt=3)
    engine = llvm.create_mcjit_compiler(module, machine)
    engine.finalize_object()
    return engine

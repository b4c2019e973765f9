// The C++ half of the Python package: Python values <-> the core's dynamic value
// (c10::IValue), and spbcast::broadcast over the c10d group behind a torch.distributed group.
//
// Only the reflection-free core is included: detail/orchestration/broadcast.hpp (spbcast::broadcast
// without the struct kinds, so no Boost header; setup.py checks) and keep_alive.hpp. dist.hpp,
// loader.hpp and spbcast.hpp name Gloo, whose headers a PyTorch wheel does not ship.
//
// The Python side (python/spbcast/_wire.py) has already turned the user's object into a tree of None,
// bool, int, float, str, bytes, CPU tensors, lists, tuples and dicts with str or int keys, and
// checked every value with its path; what reaches to_ivalue is only that vocabulary. The one
// tagged form handled here is bytes: an IValue string cannot tell text from bytes, so bytes
// travel as the tuple (TAG_BYTES, string) and come back as Python bytes.
#include <spbcast/detail/orchestration/broadcast.hpp>
#include <spbcast/detail/orchestration/keep_alive.hpp>

#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#if !SPBCAST_TORCH_AT_LEAST(2, 0)
#error "spbcast's Python package builds against a PyTorch 2.x wheel; the include path found LibTorch 1.x headers"
#endif

namespace py = pybind11;

namespace {

// Tags of the Python layer's tuples (the first element of every tuple on the wire); shared with
// python/spbcast/_wire.py through module attributes, so there is one definition.
constexpr int64_t TAG_TUPLE = 0;
constexpr int64_t TAG_BYTES = 1;
constexpr int64_t TAG_OBJECT = 2;
// A str that is not valid UTF-8 (lone surrogates, as os.fsdecode gives a file name that is not
// UTF-8): its "surrogatepass" bytes, decoded the same way on the follower.
constexpr int64_t TAG_SURROGATE_STR = 12;

// What a follower cannot read in the tree the core rebuilt; raised as spbcast.SchemaError.
struct unreadable_value {
    std::string what;
};

[[noreturn]] void type_error(const std::string& what) { throw py::type_error("spbcast: " + what); }

int64_t to_int64(py::handle h) {
    int overflow = 0;
    const long long v = PyLong_AsLongLongAndOverflow(h.ptr(), &overflow);
    if (overflow != 0) type_error("an int outside the int64 range reached the C++ encoder");
    if (v == -1 && PyErr_Occurred()) throw py::error_already_set();
    return static_cast<int64_t>(v);
}

std::string utf8_key(PyObject* key) {
    Py_ssize_t size = 0;
    const char* data = PyUnicode_AsUTF8AndSize(key, &size);
    if (data == nullptr) {
        PyErr_Clear();  // the Python encoder refuses these keys first, naming the path
        type_error("a dict key that is not valid UTF-8 reached the C++ encoder");
    }
    return std::string(data, static_cast<std::size_t>(size));
}

c10::IValue to_ivalue(py::handle h) {
    if (h.is_none()) return c10::IValue();
    if (THPVariable_Check(h.ptr())) return THPVariable_Unpack(h.ptr());
    if (PyBool_Check(h.ptr())) return h.ptr() == Py_True;
    if (PyLong_CheckExact(h.ptr())) return to_int64(h);
    if (PyFloat_CheckExact(h.ptr())) return PyFloat_AS_DOUBLE(h.ptr());
    if (PyUnicode_CheckExact(h.ptr())) {
        Py_ssize_t size = 0;
        if (const char* data = PyUnicode_AsUTF8AndSize(h.ptr(), &size))
            return std::string(data, static_cast<std::size_t>(size));
        PyErr_Clear();  // lone surrogates: the tagged form
        py::object bytes = py::reinterpret_steal<py::object>(
            PyUnicode_AsEncodedString(h.ptr(), "utf-8", "surrogatepass"));
        if (!bytes) throw py::error_already_set();
        char* data = nullptr;
        PyBytes_AsStringAndSize(bytes.ptr(), &data, &size);
        return c10::ivalue::Tuple::create(
            {c10::IValue(TAG_SURROGATE_STR), c10::IValue(std::string(data, static_cast<std::size_t>(size)))});
    }
    if (PyBytes_CheckExact(h.ptr())) {
        char* data = nullptr;
        Py_ssize_t size = 0;
        PyBytes_AsStringAndSize(h.ptr(), &data, &size);
        return std::string(data, static_cast<std::size_t>(size));
    }
    if (PyList_CheckExact(h.ptr())) {
        c10::impl::GenericList list(c10::AnyType::get());
        const Py_ssize_t n = PyList_GET_SIZE(h.ptr());
        list.reserve(static_cast<std::size_t>(n));
        for (Py_ssize_t i = 0; i < n; ++i) list.push_back(to_ivalue(PyList_GET_ITEM(h.ptr(), i)));
        return list;
    }
    if (PyTuple_CheckExact(h.ptr())) {
        const Py_ssize_t n = PyTuple_GET_SIZE(h.ptr());
        std::vector<c10::IValue> elements;
        elements.reserve(static_cast<std::size_t>(n));
        for (Py_ssize_t i = 0; i < n; ++i) elements.push_back(to_ivalue(PyTuple_GET_ITEM(h.ptr(), i)));
        return c10::ivalue::Tuple::create(std::move(elements));
    }
    if (PyDict_CheckExact(h.ptr())) {
        // Keys are all str or all int (the Python encoder checked); an empty dict is str-keyed.
        PyObject* key = nullptr;
        PyObject* value = nullptr;
        Py_ssize_t pos = 0;
        bool int_keys = false;
        if (PyDict_Next(h.ptr(), &pos, &key, &value)) int_keys = PyLong_CheckExact(key);
        const c10::TypePtr key_type = int_keys ? c10::TypePtr(c10::IntType::get())
                                               : c10::TypePtr(c10::StringType::get());
        c10::impl::GenericDict dict(key_type, c10::AnyType::get());
        dict.reserve(static_cast<std::size_t>(PyDict_GET_SIZE(h.ptr())));
        pos = 0;
        while (PyDict_Next(h.ptr(), &pos, &key, &value)) {
            c10::IValue k;
            if (int_keys && PyLong_CheckExact(key)) k = to_int64(key);
            else if (!int_keys && PyUnicode_CheckExact(key)) k = utf8_key(key);
            else type_error("a dict whose keys are not all str or all int reached the C++ encoder");
            dict.insert(std::move(k), to_ivalue(value));
        }
        return dict;
    }
    type_error(std::string("a value of type ") + Py_TYPE(h.ptr())->tp_name +
               " reached the C++ encoder; only spbcast._wire's vocabulary may");
}

py::object utf8_str(const std::string& s, const char* errors) {
    PyObject* text = PyUnicode_DecodeUTF8(s.data(), static_cast<Py_ssize_t>(s.size()), errors);
    if (text == nullptr) {
        PyErr_Clear();
        throw unreadable_value{std::string("a str that is not UTF-8") +
                               (errors[0] == 's' && errors[1] == 't' ? "" : " even with surrogates")};
    }
    return py::reinterpret_steal<py::object>(text);
}

py::object from_ivalue(const c10::IValue& v) {
    if (v.isNone()) return py::none();
    // Wrapping returns the Python object already bound to the TensorImpl, so a tensor that the
    // core rebuilt once and referenced twice is one Python object referenced twice.
    if (v.isTensor()) return py::reinterpret_steal<py::object>(THPVariable_Wrap(v.toTensor()));
    if (v.isBool()) return py::bool_(v.toBool());
    if (v.isInt()) return py::int_(v.toInt());
    if (v.isDouble()) return py::float_(v.toDouble());
    if (v.isString()) return utf8_str(v.toStringRef(), "strict");
    if (v.isList()) {
        const auto elements = v.toListRef();
        py::list out(elements.size());
        for (std::size_t i = 0; i < elements.size(); ++i) out[i] = from_ivalue(elements[i]);
        return std::move(out);
    }
    if (v.isGenericDict()) {
        py::dict out;
        for (const auto& entry : v.toGenericDict()) out[from_ivalue(entry.key())] = from_ivalue(entry.value());
        return std::move(out);
    }
    if (v.isTuple()) {
        const auto& elements = v.toTupleRef().elements();
        if (elements.size() == 2 && elements[0].isInt() && elements[0].toInt() == TAG_BYTES &&
            elements[1].isString()) {
            const auto& s = elements[1].toStringRef();
            return py::bytes(s.data(), s.size());
        }
        if (elements.size() == 2 && elements[0].isInt() && elements[0].toInt() == TAG_SURROGATE_STR &&
            elements[1].isString())
            return utf8_str(elements[1].toStringRef(), "surrogatepass");
        py::tuple out(elements.size());
        for (std::size_t i = 0; i < elements.size(); ++i) out[i] = from_ivalue(elements[i]);
        return std::move(out);
    }
    throw spbcast::error(spbcast::errc::corrupt_frame,
                         "spbcast: the root sent an IValue of kind " + v.tagKind() +
                             ", which the Python package never sends");
}

const char* errc_name(spbcast::errc code) {
    using spbcast::errc;
    switch (code) {
        case errc::unsupported_value: return "unsupported_value";
        case errc::limit_exceeded: return "limit_exceeded";
        case errc::corrupt_frame: return "corrupt_frame";
        case errc::version_mismatch: return "version_mismatch";
        case errc::schema_mismatch: return "schema_mismatch";
        case errc::payload_corrupt: return "payload_corrupt";
        case errc::remote: return "remote";
        case errc::transport: return "transport";
        case errc::timeout: return "timeout";
        case errc::invalid_argument: return "invalid_argument";
        case errc::loader: return "loader";
        case errc::out_of_step: return "out_of_step";
    }
    return "error";
}

// Raises the Python class of spbcast.errors that mirrors the C++ exception (GIL held).
[[noreturn]] void raise_python(const spbcast::error& e) {
    py::module_ errors = py::module_::import("spbcast.errors");
    py::object exc;
    const char* code = errc_name(e.code());
    if (auto* r = dynamic_cast<const spbcast::remote_error*>(&e))
        exc = errors.attr("RemoteError")(e.what(), code, r->root_rank(), r->root_message());
    else if (auto* s = dynamic_cast<const spbcast::schema_error*>(&e))
        exc = errors.attr("SchemaError")(e.what(), code, s->local_schema(), s->root_schema());
    else if (auto* t = dynamic_cast<const spbcast::transport_error*>(&e))
        exc = errors.attr("TransportError")(e.what(), code, t->phase());
    else
        exc = errors.attr("Error")(e.what(), code);
    PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
    throw py::error_already_set();
}

// The C++ group behind a Python torch.distributed group: torch's own pybind11 binding holds it
// as c10::intrusive_ptr<c10d::ProcessGroup>, so a cast hands us that very object. If the cast is
// refused (an extension whose pybind11 internals differ from torch's), torch's C++ group
// registry resolves the group by its name.
c10::intrusive_ptr<c10d::ProcessGroup> cpp_group(py::handle group, const std::string& group_name) {
    try {
        return py::cast<c10::intrusive_ptr<c10d::ProcessGroup>>(group);
    } catch (const py::cast_error&) {
        return c10d::resolve_process_group(group_name);
    }
}

// The C++ group of a Python group: through torch's binding, or (use_registry, for the tests of
// the fallback) through torch's C++ group registry.
c10::intrusive_ptr<c10d::ProcessGroup> resolve_group(py::handle group, const std::string& group_name,
                                                     bool use_registry) {
    return use_registry ? c10d::resolve_process_group(group_name) : cpp_group(group, group_name);
}

std::chrono::milliseconds to_milliseconds(double seconds) {
    return std::chrono::milliseconds(std::max<int64_t>(1, static_cast<int64_t>(seconds * 1000.0 + 0.5)));
}

// The options of one broadcast; the Python side has validated every value. Unset values keep
// the C++ defaults (timeout 5 minutes; root_wait 0, which means timeout; relay chunks of 4 MiB).
// transport: "auto", "network", "shared_memory" or "hierarchical" (spbcast::transport_mode).
spbcast::options make_options(int root, std::optional<double> timeout_s, std::optional<double> root_wait_s,
                              bool checksum, const std::string& transport,
                              std::optional<std::size_t> relay_chunk_bytes = std::nullopt) {
    spbcast::options opts;
    opts.root = root;
    opts.checksum = checksum;
    opts.transport = transport == "network"         ? spbcast::transport_mode::network
                     : transport == "shared_memory" ? spbcast::transport_mode::shared_memory
                     : transport == "hierarchical"  ? spbcast::transport_mode::hierarchical
                                                    : spbcast::transport_mode::automatic;
    if (timeout_s) opts.timeout = to_milliseconds(*timeout_s);
    if (root_wait_s) opts.root_wait = to_milliseconds(*root_wait_s);
    if (relay_chunk_bytes) opts.relay_chunk_bytes = *relay_chunk_bytes;
    return opts;
}

// A value converted for the wire, held between the two calls so that a failing conversion on
// the root is known before any collective (the root then sends its error instead).
struct wire_value {
    c10::IValue value;
};

// Releases the GIL around a blocking call, as py::gil_scoped_release. A thread that comes back
// while the interpreter is finalizing - a daemon thread left in a receive at exit (a
// LeaderLoader's prefetch thread whose leader never sent again) - must not take the GIL back:
// Python would end it with pthread_exit, whose forced unwinding through this frame (noexcept
// destructors) aborts the process. It waits there for the process to exit instead.
class gil_released_while_blocked {
public:
    gil_released_while_blocked() : state_(PyEval_SaveThread()) {}
    ~gil_released_while_blocked() {
        while (interpreter_finalizing()) std::this_thread::sleep_for(std::chrono::hours(1));
        PyEval_RestoreThread(state_);
    }
    gil_released_while_blocked(const gil_released_while_blocked&) = delete;
    gil_released_while_blocked& operator=(const gil_released_while_blocked&) = delete;

private:
    static bool interpreter_finalizing() {
#if PY_VERSION_HEX >= 0x030D0000
        return Py_IsFinalizing();
#else
        return _Py_IsFinalizing();
#endif
    }
    PyThreadState* state_;
};

// root: the group rank of the sender; value: the root's wire_value (None on the other ranks).
// Returns the root's value on followers, None on the root.
py::object broadcast(py::handle group, const std::string& group_name, const wire_value* value,
                     int root, std::optional<double> timeout_s, bool checksum, bool use_registry,
                     const std::string& transport, std::optional<double> root_wait_s,
                     std::optional<std::size_t> relay_chunk_bytes) {
    auto pg = resolve_group(group, group_name, use_registry);
    const spbcast::options opts = make_options(root, timeout_s, root_wait_s, checksum, transport, relay_chunk_bytes);
    const bool is_root = pg->getRank() == root;
    if (is_root && value == nullptr)
        throw py::value_error("spbcast: the root must pass its converted value");
    c10::IValue iv = is_root ? value->value : c10::IValue();
    try {
        gil_released_while_blocked no_gil;  // bytes move without the GIL
        spbcast::broadcast(iv, pg, opts);
    } catch (const spbcast::error& e) {
        raise_python(e);
    }
    if (is_root) return py::none();
    try {
        return from_ivalue(iv);
    } catch (const spbcast::error& e) {
        raise_python(e);
    } catch (const unreadable_value& e) {
        raise_python(spbcast::schema_error("spbcast: rank " + std::to_string(pg->getRank()) +
                                               ": the root sent " + e.what +
                                               ", which this version of the spbcast package cannot read",
                                           "", ""));
    }
}

// spbcast::detail::keep_alive for Python (LeaderLoader): while it is open on the root, a C++
// thread sends a keep-alive frame every timeout/4, so followers waiting in the next broadcast
// know the root is still producing its value and do not time out. It never takes the GIL. On
// the other ranks it does nothing.
struct python_keep_alive {
    using group_ptr = c10::intrusive_ptr<c10d::ProcessGroup>;
    group_ptr group;  // declared first, destroyed last: the thread uses the group until joined
    std::mutex mutex;
    std::unique_ptr<spbcast::detail::keep_alive<group_ptr>> alive;

    // Stops the thread (joining it: at most one keep-alive send in flight); idempotent.
    void close() {
        std::unique_ptr<spbcast::detail::keep_alive<group_ptr>> stopping;
        {
            std::lock_guard<std::mutex> lock(mutex);
            stopping = std::move(alive);
        }
        // `stopping` joins the thread here, outside the lock.
    }
};

// The same-host state of (group, root) on this rank: true when the handshake chose the
// same-host path, false when it chose the network, None before the first broadcast that may use
// it decided (transport "network" decides nothing) or after close_same_host_channels. The rule
// detail/loader/step_exchange.hpp's batches_in_shared_memory() reads.
std::optional<bool> same_host_path(py::handle group, const std::string& group_name, int root,
                                   bool use_registry) {
    auto pg = resolve_group(group, group_name, use_registry);
    const auto state = spbcast::detail::same_host_registry::instance().find(pg.get(), root);
    if (!state || state->watch_only) return std::nullopt;
    return state->shared;
}

// The hosts the hierarchical path relays to for (group, root) on this rank, the root's first,
// each as (host leader, its other ranks) in group ranks; None where this rank does not relay
// (not decided yet, one host, or the network path). For the tests: they check the path taken.
std::optional<std::vector<std::pair<int, std::vector<int>>>> relay_hosts(py::handle group, const std::string& group_name,
                                                                         int root, bool use_registry) {
    auto pg = resolve_group(group, group_name, use_registry);
    const auto state = spbcast::detail::same_host_registry::instance().find(pg.get(), root);
    if (!state || !state->shared || !state->relays()) return std::nullopt;
    std::vector<std::pair<int, std::vector<int>>> hosts;
    for (const auto& host : state->hosts) hosts.emplace_back(host.leader, host.members);
    return hosts;
}

// A spbcast::shared_memory_scope that Python opens and closes (spbcast.shared_memory). close()
// and the destructor (the Python object collected unclosed) end the C++ scope exactly once,
// whichever thread runs them.
struct python_shared_memory_scope {
    std::mutex mutex;
    std::optional<spbcast::shared_memory_scope> scope;

    void close() {
        std::lock_guard<std::mutex> lock(mutex);
        scope.reset();
    }
};

bool dtype_supported(const at::Tensor& t) {
    return spbcast::detail::dtype_code(t.scalar_type()).has_value();
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.doc() = "spbcast's C++ core, bound for Python (use the spbcast package, not this module)";
    m.attr("TAG_TUPLE") = TAG_TUPLE;
    m.attr("TAG_BYTES") = TAG_BYTES;
    m.attr("TAG_OBJECT") = TAG_OBJECT;
    m.attr("TAG_SURROGATE_STR") = TAG_SURROGATE_STR;
    // The core's default bounds, which the Python encoder checks first to name the Python path.
    m.attr("MAX_STRING_BYTES") = spbcast::limits{}.max_string_bytes;
    m.attr("MAX_IVALUE_DEPTH") = spbcast::limits{}.max_depth;
    // The core clamps options.relay_chunk_bytes to at most this; Python caps a larger int here
    // too, so that any positive int fits a size_t.
    m.attr("MAX_RELAY_CHUNK_BYTES") = spbcast::detail::max_relay_chunk_bytes;
    py::class_<wire_value>(m, "WireValue");
    m.def("to_wire", [](py::handle tree) { return wire_value{to_ivalue(tree)}; }, py::arg("tree"));
    // The tree a follower's decoder gets for a tree the root converted, without a group: for
    // the fuzz target and the tests of the decoder (python/tests/test_decoder.py).
    m.def("through_wire", [](py::handle tree) {
        const c10::IValue v = to_ivalue(tree);
        try {
            return from_ivalue(v);
        } catch (const unreadable_value& e) {
            raise_python(spbcast::schema_error("spbcast: the root sent " + e.what, "", ""));
        }
    }, py::arg("tree"));
    m.def("broadcast", &broadcast, py::arg("group"), py::arg("group_name"),
          py::arg("value").none(true), py::arg("root"), py::arg("timeout_s"), py::arg("checksum"),
          py::arg("use_registry") = false, py::arg("transport") = "auto",
          py::arg("root_wait_s") = py::none(), py::arg("relay_chunk_bytes") = py::none());
    py::class_<python_keep_alive>(m, "KeepAlive")
        .def(py::init([](py::handle group, const std::string& group_name, int root,
                         std::optional<double> timeout_s, bool use_registry, const std::string& transport) {
                 auto k = std::make_unique<python_keep_alive>();
                 k->group = resolve_group(group, group_name, use_registry);
                 const spbcast::options opts = make_options(root, timeout_s, std::nullopt, false, transport);
                 try {
                     spbcast::detail::check_options(opts, k->group->getRank(), k->group->getSize());
                 } catch (const spbcast::error& e) {
                     raise_python(e);
                 }
                 k->alive = std::make_unique<spbcast::detail::keep_alive<python_keep_alive::group_ptr>>(k->group, opts);
                 return k;
             }),
             py::arg("group"), py::arg("group_name"), py::arg("root"), py::arg("timeout_s"),
             py::arg("use_registry") = false, py::arg("transport") = "auto")
        // Joining waits for a keep-alive send in flight, which needs no GIL: release it.
        .def("close", &python_keep_alive::close, py::call_guard<py::gil_scoped_release>())
        .def("__enter__", [](py::object self) { return self; })
        .def("__exit__", [](python_keep_alive& k, py::args) {
            py::gil_scoped_release no_gil;
            k.close();
            return false;  // an exception in the block propagates
        });
    m.def("same_host_path", &same_host_path, py::arg("group"), py::arg("group_name"), py::arg("root"),
          py::arg("use_registry") = false);
    m.def("relay_hosts", &relay_hosts, py::arg("group"), py::arg("group_name"), py::arg("root"),
          py::arg("use_registry") = false);
    // For the tests: whether torch's binding hands over the C++ group (the registry is not used).
    m.def("binding_cast_works", [](py::handle group) {
        try {
            return py::cast<c10::intrusive_ptr<c10d::ProcessGroup>>(group).defined();
        } catch (const py::cast_error&) {
            return false;
        }
    });
    m.def("dtype_supported", &dtype_supported, py::arg("tensor"));
    m.def("set_receive_cache_limit", [](std::size_t bytes) { spbcast::set_receive_cache_limit(bytes); },
          py::arg("bytes"));
    py::class_<python_shared_memory_scope>(m, "SharedMemoryScope")
        .def(py::init([](std::size_t min_bytes) {
                 auto s = std::make_unique<python_shared_memory_scope>();
                 s->scope.emplace(min_bytes);
                 return s;
             }),
             py::arg("min_bytes"))
        // Ending a scope opened on another thread may wait for that thread's allocator.
        .def("close", &python_shared_memory_scope::close, py::call_guard<py::gil_scoped_release>());
    // The pool's controls (include/spbcast/shared_memory.hpp); the GIL is released, as they may
    // free segments or close sockets.
    m.def("set_shared_memory_limits", [](std::optional<std::size_t> free_bytes, std::optional<std::size_t> free_segments,
                                         std::optional<std::size_t> segments, std::optional<std::size_t> free_batches) {
              auto limits = spbcast::shared_memory_limits_in_use();
              limits.free_bytes = free_bytes.value_or(limits.free_bytes);
              limits.free_segments = free_segments.value_or(limits.free_segments);
              limits.segments = segments.value_or(limits.segments);
              limits.free_batches = free_batches.value_or(limits.free_batches);
              {
                  py::gil_scoped_release no_gil;
                  spbcast::set_shared_memory_limits(limits);
              }
              return py::make_tuple(limits.free_bytes, limits.free_segments, limits.segments, limits.free_batches);
          },
          py::arg("free_bytes"), py::arg("free_segments"), py::arg("segments"), py::arg("free_batches"));
    m.def("set_receive_cache_limits", [](std::optional<std::size_t> bytes, std::optional<std::size_t> batches) {
              auto limits = spbcast::receive_cache_limits_in_use();
              limits.bytes = bytes.value_or(limits.bytes);
              limits.batches = batches.value_or(limits.batches);
              {
                  py::gil_scoped_release no_gil;
                  spbcast::set_receive_cache_limits(limits);
              }
              return py::make_tuple(limits.bytes, limits.batches);
          },
          py::arg("bytes"), py::arg("batches"));
    m.def("set_shared_memory_limit", [](std::size_t bytes) { spbcast::set_shared_memory_limit(bytes); },
          py::arg("bytes"), py::call_guard<py::gil_scoped_release>());
    m.def("release_shared_memory", [] { spbcast::release_shared_memory(); },
          py::call_guard<py::gil_scoped_release>());
    m.def("close_same_host_channels", [] { spbcast::close_same_host_channels(); },
          py::call_guard<py::gil_scoped_release>());
    m.def("shared_memory_statistics", [] {
        const auto s = spbcast::shared_memory_statistics();
        py::dict out;
        out["limit_bytes"] = s.limit_bytes;
        out["cached_bytes"] = s.cached_bytes;
        out["held_bytes"] = s.held_bytes;
        out["segments_reused"] = s.segments_reused;
        out["segments_created"] = s.segments_created;
        out["network_fallbacks"] = s.network_fallbacks;
        out["tensors_allocated"] = s.tensors_allocated;
        out["tensors_shared"] = s.tensors_shared;
        out["segments"] = s.segments;
        out["segments_forgotten"] = s.segments_forgotten;
        out["largest_batch_bytes"] = s.largest_batch_bytes;
        return out;
    });
    m.def("receive_cache_statistics", [] {
        const auto s = spbcast::receive_cache_statistics();
        py::dict out;
        out["limit_bytes"] = s.limit_bytes;
        out["cached_bytes"] = s.cached_bytes;
        out["blocks_reused"] = s.blocks_reused;
        out["blocks_allocated"] = s.blocks_allocated;
        out["largest_batch_bytes"] = s.largest_batch_bytes;
        return out;
    });
}

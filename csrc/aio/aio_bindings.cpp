// pybind11 face of the engine: File, Engine, Request, and small helpers
// (build/probe status, mlock). Every blocking call releases the GIL. Python
// validates tensors and passes raw addresses; no torch headers here.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cerrno>
#include <cstring>
#include <sys/mman.h>
#include <sys/resource.h>

#include "aio_engine.h"

namespace py = pybind11;
using namespace infinity_aio;

namespace {

// C++ errors become OSError(errno, message, path); infinity.io turns them
// into AioError with offset and length.
void raise_os_error(const AioOsError& e) {
    py::object exc = py::module_::import("builtins").attr("OSError")(
        e.err, e.what(), e.path.empty() ? py::object(py::none()) : py::object(py::str(e.path)));
    exc.attr("aio_offset") = py::int_(e.offset);
    exc.attr("aio_length") = py::int_(e.length);
    PyErr_SetObject(PyExc_OSError, exc.ptr());
}

std::vector<Segment> to_segments(const py::list& segs) {
    std::vector<Segment> out;
    out.reserve(segs.size());
    for (auto item : segs) {
        auto t = item.cast<py::tuple>();
        if (t.size() != 4) throw std::invalid_argument("segment must be (File, address, offset, length)");
        Segment s;
        s.file = t[0].cast<std::shared_ptr<File>>();
        if (s.file->fd() < 0) throw std::invalid_argument("file " + s.file->path() + " is closed");
        s.buf = reinterpret_cast<char*>(t[1].cast<uintptr_t>());
        s.offset = t[2].cast<uint64_t>();
        s.len = t[3].cast<uint64_t>();
        out.push_back(std::move(s));
    }
    return out;
}

}  // namespace

PYBIND11_MODULE(_aio, m) {
    m.doc() = "infinity asynchronous NVMe I/O engine (io_uring + POSIX fallback)";

    py::register_exception_translator([](std::exception_ptr p) {
        try {
            if (p) std::rethrow_exception(p);
        } catch (const AioOsError& e) {
            raise_os_error(e);
        }
    });

    m.def("built_with_liburing", &built_with_liburing,
          "True when this build links liburing (io_uring engine available)");
    m.def("uring_probe", [] {
        py::gil_scoped_release nogil;
        return uring_probe();
    }, "0 when an io_uring can be created and used here, else the errno that stopped it");
    m.def("mlock", [](uintptr_t addr, size_t len) {
        return ::mlock(reinterpret_cast<void*>(addr), len) == 0 ? 0 : errno;
    }, "mlock(2); returns 0 or errno");
    m.def("munlock", [](uintptr_t addr, size_t len) {
        return ::munlock(reinterpret_cast<void*>(addr), len) == 0 ? 0 : errno;
    });
    m.def("memlock_limit", [] {
        struct rlimit rl;
        if (getrlimit(RLIMIT_MEMLOCK, &rl) != 0) return py::make_tuple(-1LL, -1LL);
        auto conv = [](rlim_t v) -> long long { return v == RLIM_INFINITY ? -1LL : (long long)v; };
        return py::make_tuple(conv(rl.rlim_cur), conv(rl.rlim_max));
    }, "(soft, hard) RLIMIT_MEMLOCK in bytes; -1 = unlimited");

    py::class_<File, std::shared_ptr<File>>(m, "File")
        .def_static("open", [](const std::string& path, bool create, bool direct, bool truncate, int mode) {
            py::gil_scoped_release nogil;
            return File::open(path, create, direct, truncate, mode);
        }, py::arg("path"), py::arg("create") = false, py::arg("direct") = true,
           py::arg("truncate") = false, py::arg("mode") = 0600)
        .def_static("open_tmpfile", [](const std::string& dir, bool direct) {
            py::gil_scoped_release nogil;
            return File::open_tmpfile(dir, direct);
        }, py::arg("dir"), py::arg("direct") = true)
        .def_property_readonly("path", &File::path)
        .def_property_readonly("fd", &File::fd)
        .def_property_readonly("direct", &File::direct)
        .def_property_readonly("direct_refused", &File::direct_refused)
        .def_property_readonly("mem_align", &File::mem_align)
        .def_property_readonly("offset_align", &File::offset_align)
        .def_property_readonly("align_source", &File::align_source)
        .def_property_readonly("closed", [](const File& f) { return f.fd() < 0; })
        .def("size", &File::size)
        .def("fallocate", [](File& f, uint64_t off, uint64_t len) {
            py::gil_scoped_release nogil;
            f.fallocate(off, len);
        })
        .def("truncate", &File::truncate)
        .def("close", [](File& f) {
            py::gil_scoped_release nogil;
            f.close();
        }, "waits for this file's in-flight transfers, then closes it (idempotent)")
        .def("__repr__", [](const File& f) {
            return "<infinity._aio.File " + f.path() + (f.direct() ? " O_DIRECT" : " buffered") + ">";
        });

    py::class_<Request, std::shared_ptr<Request>>(m, "Request")
        .def("wait", [](Request& r) {
            py::gil_scoped_release nogil;
            return r.wait();
        }, "block until complete (GIL released); returns bytes transferred")
        .def("done", &Request::done)
        .def_property_readonly("total", [](const Request& r) { return r.total; })
        .def_property_readonly("nbytes", &Request::bytes)
        .def("error", [](const Request& r) -> py::object {
            if (!r.done() || r.error() == 0) return py::none();
            return py::make_tuple(r.error(), r.error_path(), r.error_offset(), r.error_length(),
                                  r.error_message());
        }, "None, or (errno, path, offset, length, message) of the first failure");

    py::class_<Engine, std::shared_ptr<Engine>>(m, "Engine")
        .def(py::init([](const std::string& kind, uint64_t bs, uint32_t qd, uint32_t threads) {
            py::gil_scoped_release nogil;
            return std::make_shared<Engine>(kind, bs, qd, threads);
        }), py::arg("kind"), py::arg("block_size"), py::arg("queue_depth"), py::arg("threads"))
        .def("submit", [](Engine& e, int op, const py::list& segs) {
            if (op != OP_READ && op != OP_WRITE) throw std::invalid_argument("op must be 0 (read) or 1 (write)");
            auto s = to_segments(segs);
            py::gil_scoped_release nogil;
            return e.submit(op, std::move(s));
        }, py::arg("op"), py::arg("segments"))
        .def("drain", [](Engine& e) {
            py::gil_scoped_release nogil;
            e.drain();
        })
        .def("close", [](Engine& e) {
            py::gil_scoped_release nogil;
            e.close();
        })
        .def_property_readonly("kind", &Engine::kind)
        .def_property_readonly("block_size", &Engine::block_size)
        .def_property_readonly("queue_depth", &Engine::queue_depth)
        .def_property_readonly("threads", &Engine::threads);

    m.attr("OP_READ") = (int)OP_READ;
    m.attr("OP_WRITE") = (int)OP_WRITE;
}

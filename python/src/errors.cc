// rd2h.Error and its subclasses, one per kind of status code a caller can react to, and the
// translator that raises a StatusError as one of them, carrying the message and `.code`.
#include <exception>
#include <string>

#include "native.h"

namespace rd2h::python {
namespace {

// The Python exception types, by status code; created once at import.
struct Errors {
  py::object base, invalid_argument, timeout, peer;
};
Errors& errors() {
  static Errors* e = new Errors();  // lives as long as the interpreter's module
  return *e;
}

void translate(const StatusError& e) {
  const Errors& err = errors();
  const py::object* type = &err.base;
  switch (e.status().code()) {
    case StatusCode::kInvalidArgument:
    case StatusCode::kOutOfRange:
    case StatusCode::kInvalidMetadata:
      type = &err.invalid_argument;
      break;
    case StatusCode::kTimeout:
      type = &err.timeout;
      break;
    case StatusCode::kPeerDead:
    case StatusCode::kUnreachable:
      type = &err.peer;
      break;
    default:
      break;
  }
  py::object exc = (*type)(e.status().message());
  exc.attr("code") = std::string(to_string(e.status().code()));
  PyErr_SetObject(type->ptr(), exc.ptr());
}

}  // namespace

void bind_errors(py::module_& m) {
  Errors& err = errors();
  err.base = py::reinterpret_steal<py::object>(PyErr_NewExceptionWithDoc(
      "rd2h.Error", "An rd2h call failed; .code names the kind.", PyExc_RuntimeError, nullptr));
  auto sub = [&](const char* name, const char* doc, PyObject* also) {
    py::tuple bases = py::make_tuple(err.base, py::handle(also));
    return py::reinterpret_steal<py::object>(
        PyErr_NewExceptionWithDoc(name, doc, bases.ptr(), nullptr));
  };
  err.invalid_argument =
      sub("rd2h.InvalidArgument", "A malformed argument, setting or message.", PyExc_ValueError);
  err.timeout = sub("rd2h.Timeout", "A bounded wait ran out.", PyExc_TimeoutError);
  err.peer = sub("rd2h.PeerError", "A peer is gone or cannot be reached.", PyExc_ConnectionError);
  m.attr("Error") = err.base;
  m.attr("InvalidArgument") = err.invalid_argument;
  m.attr("Timeout") = err.timeout;
  m.attr("PeerError") = err.peer;
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const StatusError& e) {
      translate(e);
    }
  });
}

}  // namespace rd2h::python

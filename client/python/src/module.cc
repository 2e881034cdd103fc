// The kvcomp._kvcomp extension module: one Register* call per concern. To add a concern, add
// its source to client/python/CMakeLists.txt and one line here.
#include <nanobind/nanobind.h>

#include "bindings.h"

NB_MODULE(_kvcomp, m) {
  m.doc() = "kvcomp: KV-cache compression engine (native part of the kvcomp package)";
  kvcomp::python::RegisterEngine(m);
  kvcomp::python::RegisterMoments(m);
  kvcomp::python::RegisterClient(m);
  kvcomp::python::RegisterCodec(m);
}

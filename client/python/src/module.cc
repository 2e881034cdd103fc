// The kvcomp._kvcomp extension module: one Register* call per concern. To add a concern, add
// its source to client/python/CMakeLists.txt and one line here. A KVCOMP_CORE_ONLY build (no
// kvcomp::client, e.g. the GPU machine) has no client binding; kvcomp/__init__.py says so.
#include <nanobind/nanobind.h>

#include "bindings.h"

NB_MODULE(_kvcomp, m) {
  m.doc() = "kvcomp: KV-cache compression engine (native part of the kvcomp package)";
  kvcomp::python::RegisterEngine(m);
  kvcomp::python::RegisterMoments(m);
#ifdef KVCOMP_PYTHON_HAS_CLIENT
  kvcomp::python::RegisterClient(m);
#endif
  kvcomp::python::RegisterCodec(m);
}

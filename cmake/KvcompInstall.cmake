# Install rules of the C++ SDK (component "devel"): the static libraries kvcomp::client needs
# (found by walking its link graph, so a library added to it later is exported too), their
# public headers, a CMake package config (find_package(kvcomp) -> kvcomp::client, kvcomp::core,
# kvcomp::kernels, ...) and a pkg-config file (kvcomp.pc). The package config finds the same
# dependencies again on the consumer's machine (Abseil, UCX, Thrift, ... through CMake or
# pkg-config, as the build did).
#
#   cmake --install <build> --prefix <dir> --component devel
include_guard(GLOBAL)
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

# pkg-config modules behind the PkgConfig::<NAME> targets kvcomp links (pkg_check_modules
# prefixes in KvcompDeps.cmake and the component CMakeLists).
set(KVCOMP_PKGCONFIG_MODULES UCX=ucx THRIFT=thrift THRIFTNB=thrift-nb CARES=libcares
    LIBEVENT=libevent)

# Depth-first walk over the kvcomp_* targets `target` links; appends each to `order` after
# everything it needs (post-order), so the reversed list is a valid static link order.
function(_kvcomp_link_walk target visited order)
  set(v ${${visited}})
  set(o ${${order}})
  if(target IN_LIST v)
    return()
  endif()
  list(APPEND v ${target})
  get_target_property(type ${target} TYPE)
  set(deps)
  if(NOT type STREQUAL "INTERFACE_LIBRARY")
    get_target_property(deps ${target} LINK_LIBRARIES)
  endif()
  get_target_property(ideps ${target} INTERFACE_LINK_LIBRARIES)
  foreach(d IN LISTS deps ideps)
    string(REGEX REPLACE "^\\$<LINK_ONLY:(.*)>$" "\\1" d "${d}")
    if(NOT TARGET "${d}")
      continue()
    endif()
    get_target_property(real "${d}" ALIASED_TARGET)
    if(NOT real)
      set(real "${d}")
    endif()
    if(real MATCHES "^kvcomp_")
      _kvcomp_link_walk(${real} v o)
    endif()
  endforeach()
  list(APPEND o ${target})
  set(${visited} ${v} PARENT_SCOPE)
  set(${order} ${o} PARENT_SCOPE)
endfunction()

# Every dependency outside kvcomp that `targets` link, as "kind:name" items: cmake:absl,
# cmake:Threads, cmake:Eigen3, cmake:CUDAToolkit, pkg:<PREFIX>.
function(_kvcomp_external_deps targets out)
  set(found)
  foreach(t IN LISTS targets)
    get_target_property(type ${t} TYPE)
    set(deps)
    if(NOT type STREQUAL "INTERFACE_LIBRARY")
      get_target_property(deps ${t} LINK_LIBRARIES)
    endif()
    get_target_property(ideps ${t} INTERFACE_LINK_LIBRARIES)
    foreach(d IN LISTS deps ideps)
      string(REGEX REPLACE "^\\$<LINK_ONLY:(.*)>$" "\\1" d "${d}")
      if(d MATCHES "^absl::(.*)")
        list(APPEND found "cmake:absl" "absl:${CMAKE_MATCH_1}")
      elseif(d MATCHES "^Threads::")
        list(APPEND found "cmake:Threads")
      elseif(d MATCHES "^Eigen3::")
        list(APPEND found "cmake:Eigen3")
      elseif(d MATCHES "^CUDA::(.*)")
        list(APPEND found "cmake:CUDAToolkit" "cuda:${CMAKE_MATCH_1}")
      elseif(d MATCHES "^PkgConfig::(.*)")
        list(APPEND found "pkg:${CMAKE_MATCH_1}")
      elseif(d MATCHES "::" AND NOT d MATCHES "^kvcomp::")
        message(FATAL_ERROR "kvcomp install: ${t} links ${d}; teach cmake/KvcompInstall.cmake "
                            "how a consumer finds it")
      endif()
    endforeach()
  endforeach()
  list(REMOVE_DUPLICATES found)
  set(${out} ${found} PARENT_SCOPE)
endfunction()

function(kvcomp_install)
  set(roots)
  # The SDK, the engine and every library the Python extension links (a wheel built against the
  # installed package needs them all).
  foreach(r kvcomp_client kvcomp_decode kvcomp_kernels)
    if(TARGET ${r})
      list(APPEND roots ${r})
    endif()
  endforeach()
  set(_kvcomp_seen)
  set(libs)
  foreach(r IN LISTS roots)
    _kvcomp_link_walk(${r} _kvcomp_seen libs)
  endforeach()
  list(REVERSE libs)  # a library before the ones it needs

  # Include directories: the source tree's at build time, <prefix>/include once installed. The
  # public headers of each library are its include/ folder.
  set(header_dirs)
  foreach(t IN LISTS libs)
    string(REGEX REPLACE "^kvcomp_" "" name ${t})
    set_target_properties(${t} PROPERTIES EXPORT_NAME ${name})
    get_target_property(incs ${t} INTERFACE_INCLUDE_DIRECTORIES)
    if(NOT incs)
      continue()
    endif()
    set(wrapped)
    foreach(i IN LISTS incs)
      if(i MATCHES "^\\$<")
        list(APPEND wrapped "${i}")
      else()
        list(APPEND wrapped "$<BUILD_INTERFACE:${i}>")
        if(i MATCHES "/include$" AND NOT i MATCHES "^${PROJECT_BINARY_DIR}")
          list(APPEND header_dirs "${i}")
        endif()
      endif()
    endforeach()
    list(APPEND wrapped "$<INSTALL_INTERFACE:${CMAKE_INSTALL_INCLUDEDIR}>")
    set_target_properties(${t} PROPERTIES INTERFACE_INCLUDE_DIRECTORIES "${wrapped}")
  endforeach()
  list(REMOVE_DUPLICATES header_dirs)

  install(TARGETS ${libs} EXPORT kvcompTargets
    ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR} COMPONENT devel
    LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR} COMPONENT devel
    INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
  foreach(d IN LISTS header_dirs)
    install(DIRECTORY ${d}/ DESTINATION ${CMAKE_INSTALL_INCLUDEDIR} COMPONENT devel
      FILES_MATCHING PATTERN "*.h" PATTERN "*.def")
  endforeach()
  set(cmake_dir ${CMAKE_INSTALL_LIBDIR}/cmake/kvcomp)
  install(EXPORT kvcompTargets NAMESPACE kvcomp:: DESTINATION ${cmake_dir} COMPONENT devel)

  # The package config: find_dependency for every outside dependency, then the targets.
  _kvcomp_external_deps("${libs}" ext)
  set(KVCOMP_FIND_DEPENDENCIES "")
  set(pc_requires)
  set(pc_libs)
  foreach(e IN LISTS ext)
    if(e STREQUAL "cmake:absl")
      string(APPEND KVCOMP_FIND_DEPENDENCIES "find_dependency(absl)\n")
    elseif(e STREQUAL "cmake:Threads")
      string(APPEND KVCOMP_FIND_DEPENDENCIES "find_dependency(Threads)\n")
      list(APPEND pc_libs -pthread)
    elseif(e STREQUAL "cmake:Eigen3")
      string(APPEND KVCOMP_FIND_DEPENDENCIES "find_dependency(Eigen3 3.3 NO_MODULE)\n")
      list(APPEND pc_requires eigen3)
    elseif(e STREQUAL "cmake:CUDAToolkit")
      string(APPEND KVCOMP_FIND_DEPENDENCIES "find_dependency(CUDAToolkit)\n")
      list(APPEND pc_libs "-L${CUDAToolkit_LIBRARY_DIR}")
    elseif(e MATCHES "^cuda:(.*)")
      list(APPEND pc_libs "-l${CMAKE_MATCH_1}")
    elseif(e MATCHES "^absl:(.*)")
      list(APPEND pc_requires "absl_${CMAKE_MATCH_1}")
    elseif(e MATCHES "^pkg:(.*)")
      set(prefix ${CMAKE_MATCH_1})
      set(module "")
      foreach(m IN LISTS KVCOMP_PKGCONFIG_MODULES)
        if(m MATCHES "^${prefix}=(.*)")
          set(module ${CMAKE_MATCH_1})
        endif()
      endforeach()
      if(NOT module)
        message(FATAL_ERROR "kvcomp install: PkgConfig::${prefix} has no module name in "
                            "KVCOMP_PKGCONFIG_MODULES (cmake/KvcompInstall.cmake)")
      endif()
      string(APPEND KVCOMP_FIND_DEPENDENCIES
             "pkg_check_modules(${prefix} REQUIRED IMPORTED_TARGET ${module})\n")
      list(APPEND pc_requires ${module})
    endif()
  endforeach()
  configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/kvcompConfig.cmake.in
    ${PROJECT_BINARY_DIR}/kvcompConfig.cmake INSTALL_DESTINATION ${cmake_dir})
  write_basic_package_version_file(${PROJECT_BINARY_DIR}/kvcompConfigVersion.cmake
    VERSION ${PROJECT_VERSION} COMPATIBILITY SameMinorVersion)
  install(FILES ${PROJECT_BINARY_DIR}/kvcompConfig.cmake
    ${PROJECT_BINARY_DIR}/kvcompConfigVersion.cmake DESTINATION ${cmake_dir} COMPONENT devel)

  # kvcomp.pc: every static library in link order, then what they need.
  set(KVCOMP_PC_LIBS "")
  foreach(t IN LISTS libs)
    get_target_property(type ${t} TYPE)
    if(type STREQUAL "STATIC_LIBRARY")
      string(APPEND KVCOMP_PC_LIBS " -l${t}")
    endif()
  endforeach()
  list(JOIN pc_libs " " pc_libs)
  string(APPEND KVCOMP_PC_LIBS " ${pc_libs}")
  list(JOIN pc_requires " " KVCOMP_PC_REQUIRES)
  # Relocatable: the prefix is where the .pc file lies, whatever --prefix the install had.
  string(REGEX MATCHALL "[^/]+" parts "${CMAKE_INSTALL_LIBDIR}/pkgconfig")
  set(KVCOMP_PC_PREFIX "\${pcfiledir}")
  foreach(p IN LISTS parts)
    string(APPEND KVCOMP_PC_PREFIX "/..")
  endforeach()
  configure_file(${PROJECT_SOURCE_DIR}/cmake/kvcomp.pc.in ${PROJECT_BINARY_DIR}/kvcomp.pc @ONLY)
  install(FILES ${PROJECT_BINARY_DIR}/kvcomp.pc
    DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig COMPONENT devel)
endfunction()

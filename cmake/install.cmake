# What `cmake --install` puts under the prefix: the public headers (include/rd2h and the
# generated rd2h/version.h), librd2h, the rd2h binary (apps/), the CMake package
# (find_package(rd2h): target rd2h::rd2h) and rd2h.pc.
include(CMakePackageConfigHelpers)

install(TARGETS rd2h EXPORT rd2hTargets
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
  ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
  RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
install(DIRECTORY ${PROJECT_SOURCE_DIR}/include/rd2h ${PROJECT_BINARY_DIR}/include/rd2h
  DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}
  FILES_MATCHING PATTERN "*.h")

set(RD2H_CMAKE_DIR ${CMAKE_INSTALL_LIBDIR}/cmake/rd2h)
install(EXPORT rd2hTargets NAMESPACE rd2h:: FILE rd2hTargets.cmake DESTINATION ${RD2H_CMAKE_DIR})
# A static librd2h needs its dependencies found where it is linked; a shared one does not.
get_target_property(RD2H_LIBRARY_TYPE rd2h TYPE)
if(RD2H_LIBRARY_TYPE STREQUAL "STATIC_LIBRARY")
  set(RD2H_STATIC ON)
else()
  set(RD2H_STATIC OFF)
endif()
configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/rd2hConfig.cmake.in
  ${PROJECT_BINARY_DIR}/rd2hConfig.cmake
  INSTALL_DESTINATION ${RD2H_CMAKE_DIR})
write_basic_package_version_file(${PROJECT_BINARY_DIR}/rd2hConfigVersion.cmake
  VERSION ${PROJECT_VERSION}
  COMPATIBILITY SameMajorVersion)
install(FILES ${PROJECT_BINARY_DIR}/rd2hConfig.cmake ${PROJECT_BINARY_DIR}/rd2hConfigVersion.cmake
  DESTINATION ${RD2H_CMAKE_DIR})

# rd2h.pc, relocatable: its prefix is found from where the file lies.
if(IS_ABSOLUTE "${CMAKE_INSTALL_LIBDIR}" OR IS_ABSOLUTE "${CMAKE_INSTALL_INCLUDEDIR}")
  set(RD2H_PC_PREFIX "${CMAKE_INSTALL_PREFIX}")
  set(RD2H_PC_LIBDIR "${CMAKE_INSTALL_FULL_LIBDIR}")
  set(RD2H_PC_INCLUDEDIR "${CMAKE_INSTALL_FULL_INCLUDEDIR}")
else()
  file(RELATIVE_PATH RD2H_PC_UP "/prefix/${CMAKE_INSTALL_LIBDIR}/pkgconfig" "/prefix")
  string(REGEX REPLACE "/$" "" RD2H_PC_UP "${RD2H_PC_UP}")
  set(RD2H_PC_PREFIX "\${pcfiledir}/${RD2H_PC_UP}")
  set(RD2H_PC_LIBDIR "\${prefix}/${CMAKE_INSTALL_LIBDIR}")
  set(RD2H_PC_INCLUDEDIR "\${prefix}/${CMAKE_INSTALL_INCLUDEDIR}")
endif()
if(RD2H_STATIC)
  # Its dependencies as the shared libraries they are here (Requires.private would drag in
  # their own static dependencies, which distributions do not all ship).
  set(RD2H_PC_PRIVATE "Libs.private: -lucp -lucs -lzmq -lcpp-httplib -lsodium -lspdlog -lfmt -pthread -lrt")
else()
  set(RD2H_PC_PRIVATE "")
endif()
configure_file(${PROJECT_SOURCE_DIR}/cmake/rd2h.pc.in ${PROJECT_BINARY_DIR}/rd2h.pc @ONLY)
install(FILES ${PROJECT_BINARY_DIR}/rd2h.pc DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig)

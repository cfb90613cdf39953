# SPDX-License-Identifier: Apache-2.0
# plan --svg writes its picture: an XML document with an <svg> root, one titled cell per rank and ring
# step of each sharding's panel (four shardings on a flat ring here), and still prints its table.
#   cmake -DPLAN=path/to/plan -DOUT=path/to/picture.svg -P check_plan_svg.cmake
file(REMOVE "${OUT}")
execute_process(COMMAND ${PLAN} --seq-len 16384 --world 4 --svg ${OUT} RESULT_VARIABLE code OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT code EQUAL 0)
  message(FATAL_ERROR "plan --svg failed (${code}): ${err}")
endif()
if(NOT out MATCHES "striped +flat_ring")
  message(FATAL_ERROR "plan --svg printed no table:\n${out}")
endif()
file(READ "${OUT}" svg)
if(NOT svg MATCHES "^<\\?xml version=\"1.0\" encoding=\"UTF-8\"\\?>\n<svg xmlns=\"http://www.w3.org/2000/svg\"" OR NOT svg MATCHES "</svg>\n$")
  message(FATAL_ERROR "${OUT} is not an SVG document")
endif()
string(REGEX MATCHALL " active entries</title></rect>" cells "${svg}")
list(LENGTH cells count)
if(NOT count EQUAL 64)  # 4 shardings (placed_stripes too) x 4 ranks x 4 steps
  message(FATAL_ERROR "${OUT}: ${count} workload cells, expected 64")
endif()
message(STATUS "${OUT}: ${count} workload cells")

# SPDX-License-Identifier: MIT
# Writes the bytes of IN as a C array SYM (and SYM_size) into OUT.
file(READ ${IN} hex HEX)
string(LENGTH "${hex}" n)
math(EXPR nbytes "${n} / 2")
string(REGEX REPLACE "([0-9a-f][0-9a-f])" "0x\\1," body "${hex}")
string(REGEX REPLACE "((0x..,){32})" "\\1\n" body "${body}")
file(WRITE ${OUT} "/* generated from ${IN} by cmake/embed.cmake */\n#include <stddef.h>\n"
     "__attribute__((aligned(16))) const unsigned char ${SYM}[] = {\n${body}\n};\n"
     "const size_t ${SYM}_size = ${nbytes};\n")

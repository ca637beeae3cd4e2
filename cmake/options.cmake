# Build options. Each can be given as -DNAME=..., through pip (--config-settings=cmake.define.NAME=...)
# or as an environment variable of the same name. FLASHTILE_KERNEL_SET picks a preset (full, dev, ci:
# see cmake/manifest.py); the other options override parts of it.
macro(ft_option name default doc)
  if(DEFINED ENV{${name}} AND NOT DEFINED ${name})
    set(${name} "$ENV{${name}}" CACHE STRING "${doc}")
  else()
    set(${name} "${default}" CACHE STRING "${doc}")
  endif()
endmacro()

ft_option(FLASHTILE_KERNEL_SET "full" "kernel preset: full | dev | ci")
ft_option(FLASHTILE_ARCHS "" "SASS targets, e.g. 80;90a (empty = preset)")
ft_option(FLASHTILE_DTYPES "" "bf16;fp16 (empty = preset)")
ft_option(FLASHTILE_HDIMS "" "head dims, e.g. 64;128;192x128 (empty = preset)")
ft_option(FLASHTILE_FEATURES "" "optional features, e.g. softcap (empty = preset; 'none' = no features)")
ft_option(FLASHTILE_PTXAS_VERBOSE "OFF" "print ptxas register/spill reports")
ft_option(FLASHTILE_EMBED_PTX "OFF" "also embed PTX of the lowest arch of each kernel family (JIT on newer GPUs)")
ft_option(FLASHTILE_HOPPER_SCHEDULE "-1" "Hopper consumer schedule override (0 serial, 1 overlap, 2 overlap+pingpong, 3 serial+pingpong; -1 policy)")

/* Press settings by name (params.c); the public face (kvc_press_spec, the setters, introspection) is in
 * kvpress_c.h. */
#ifndef KVC_PRESS_PARAMS_H
#define KVC_PRESS_PARAMS_H

#include "../include/kvpress_c.h"

/* The config a spec holds (the engine's internal form). */
const kvc_press_config *kvc_press_spec_config(const kvc_press_spec *p);

#endif

/* A model's identity, as a saved cache records it: its configuration (every kvc_config field, a JSON
 * object) and a digest of its tensors (SHA-256 of its weight files' bytes: the GGUF file, or a folder's
 * *.safetensors in name order), so a cache is never loaded onto another model. */
#ifndef KVC_MODEL_ID_H
#define KVC_MODEL_ID_H

#include "../model/model.h"

/* "sha256:<64 hex>" of the model's weight files into out[72]; computed once per model, then kept. */
kvc_status kvc_model_id_digest(kvc_model *m, char out[72]);
/* The configuration as a JSON object; NULL when out of memory (malloc'ed). */
char *kvc_model_id_config_json(const kvc_config *c);
/* KVC_OK when the JSON object `text` (a file's) describes configuration c; otherwise KVC_ERR_FORMAT naming
 * the first field that differs (`what` names the file). */
kvc_status kvc_model_id_check_config(const kvc_config *c, const char *text, const char *what);

#endif

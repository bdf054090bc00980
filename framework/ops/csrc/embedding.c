/* Token embedding: rows of a float32 table gathered by token id (shared among the threads of
   an enclosing team, csrc/plan.h; alone, by the calling thread). */
#include <stdint.h>
#include <string.h>
#include "plan.h"

/* out[i] = table[ids[i]] for n ids, rows of dim floats. */
void embedding(float *out, const float *table, const int64_t *ids, int64_t n, int64_t dim)
{
    #pragma omp for
    for (int64_t i = 0; i < n; ++i) memcpy(out + i * dim, table + ids[i] * dim, sizeof(float) * dim);
}

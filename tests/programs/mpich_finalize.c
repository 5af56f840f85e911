/* Preloaded into MPICH ranks by tests/test_mpi.py (after the layer): MPICH 4.0's MPI_Finalize
 * closes every UCX endpoint with ucp_disconnect_nb (a flush: over TCP it can wait for the
 * peer's acknowledgement of a PUT) and then waits in a PMI barrier, where it no longer
 * progresses UCX; a rank whose flush needs a peer already in the barrier waits forever, the
 * peer waits for it. Natively, three ranks on three namespace hosts hang so in 5 runs of 5;
 * MPICH 4.2 removed the barrier (pmodels/mpich pull request 6596). Here the endpoints are
 * left to ucp_worker_destroy, later in MPI_Finalize, which releases them without waiting for
 * peers (a forced close, UCP_EP_CLOSE_MODE_FORCE, is refused for MPICH's endpoints: they are
 * not created for peer error handling). Every message of the program is complete when
 * MPI_Finalize is called, so nothing is lost: bytes already written to a socket are the
 * socket's (and, under the layer, the virtual connection's) to deliver. */
#include <ucp/api/ucp.h>

ucs_status_ptr_t ucp_disconnect_nb(ucp_ep_h ep) {
    (void)ep;
    return NULL; /* UCS_OK: nothing to wait for */
}

/* Per-packet loops of the UDP transport (pydblp/transport/udp.py).
 *
 * dblp_udp_gro_read   reads merged (UDP_GRO) messages into rows of a frames buffer,
 *                     re-cuts them one datagram a row, names each datagram's peer
 *                     and gives it its message's ECN field.
 * dblp_udp_send       groups a batch into sendmmsg messages (UDP_SEGMENT runs of one
 *                     peer, size and TOS) and sends them, header and payload straight
 *                     from the caller's rows.
 *
 * Each does what udp.py's Python path does, result for result (tests/unit/
 * test_udp_native.py runs both on the same input); waiting, lingering and every
 * decision stay in Python.  Neither blocks: both use MSG_DONTWAIT and return
 * what they did, and the caller waits in poll(2).  ctypes releases the GIL
 * around each call.
 */

#define _GNU_SOURCE
#include <errno.h>
#include <netinet/in.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>

#include "wire.h"

#define KIND_AT 3    /* the kind byte in a DBLP header */
#define SOL_UDP_ 17
#define UDP_SEGMENT_ 103
#define UDP_GRO_ 104
#define GRO_SEGS 64  /* datagrams UDP_GRO merges into one message at most */
#define GSO_MAX_SEGS 64
#define GSO_MAX_BYTES 65000

/* The peer id whose socket address (rows of `names`, `stride` bytes each) has the
 * source's address bytes [keyoff, keyoff + keylen): the first registered, else -1. */
static int32_t peer_of(const uint8_t *src, const uint8_t *names, int64_t npeer, int64_t stride,
                       int64_t keyoff, int64_t keylen) {
    for (int64_t i = 0; i < npeer; i++)
        if (!memcmp(src + keyoff, names + i * stride + keyoff, keylen)) return (int32_t)i;
    return -1;
}

/* Move the datagrams of a merged message (total bytes of g-byte datagrams, read as
 * one stream at f) to one per row; as udp.py's _recut.  Returns rows used. */
static int64_t recut(uint8_t *f, int64_t row, int64_t total, int64_t g, int64_t *lost, int64_t *last) {
    int64_t c = (total + g - 1) / g, n = c < GRO_SEGS ? c : GRO_SEGS;
    for (int64_t k = 1; k < n; k++) {
        int64_t i = g < row ? n - k : k; /* never overwrite a datagram not moved yet */
        int64_t w = total - i * g;
        if (w > g) w = g;
        if (w > row) w = row;
        memmove(f + i * row, f + i * g, w);
        if (w < HEADER_LEN) memset(f + i * row + w, 0, HEADER_LEN - w);
    }
    if (g < HEADER_LEN) memset(f + g, 0, HEADER_LEN - g);
    *lost = c - n;
    *last = total - (n - 1) * g < g ? total - (n - 1) * g : g;
    return n;
}

/* Read messages (MSG_DONTWAIT) into `frames` from row `used` while one is queued and
 * GRO_SEGS rows are left below `cap` (a message never takes rows past `cap`: plen, peer
 * and ecn need `cap` rows).  Per row: plen (the datagram's UDP payload
 * size), peer and ecn (the low 2 bits of its IP_TOS / IPV6_TCLASS cmsg, 0 without
 * one: a message's datagrams share one IP header's, since GRO merges none of another
 * TOS).  Adds to res: [0] datagrams lost (past GRO_SEGS in a message), [1] datagrams
 * received merged, [2] bytes, [3] the widest datagram, [4] 1 once a control packet
 * came, [5] errno of a failed read (reading stops), [6] messages, [7] datagrams whose
 * header fails wire.all_valid's checks (the caller then tells which, as in Python).
 * Returns the rows used now. */
int64_t dblp_udp_gro_read(int fd, uint8_t *frames, int64_t size, int64_t row, int64_t used, int64_t cap,
                          const uint8_t *names, int64_t npeer, int64_t stride, int64_t keyoff, int64_t keylen,
                          int64_t *plen, int32_t *peer, uint8_t *ecn, int64_t *res) {
    struct sockaddr_in6 from;
    /* UDP_GRO's int, then the TOS (IP_TOS: 1 byte; IPV6_TCLASS: an int); aligned for cmsghdr */
    union {
        char buf[2 * CMSG_SPACE(sizeof(int))];
        struct cmsghdr align;
    } control;
    while (cap - used >= GRO_SEGS) {
        uint8_t *f = frames + used * row;
        struct iovec iov = {f, (size_t)(size - used * row)};
        struct msghdr msg = {.msg_name = &from, .msg_namelen = sizeof from, .msg_iov = &iov, .msg_iovlen = 1,
                             .msg_control = control.buf, .msg_controllen = sizeof control.buf};
        ssize_t got = recvmsg(fd, &msg, MSG_DONTWAIT | MSG_TRUNC);
        if (got < 0) {
            if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) res[5] = errno;
            break;
        }
        int64_t total = got, g = got;
        uint8_t e = 0;
        for (struct cmsghdr *cm = CMSG_FIRSTHDR(&msg); cm; cm = CMSG_NXTHDR(&msg, cm)) {
            if (cm->cmsg_level == SOL_UDP_ && cm->cmsg_type == UDP_GRO_ && cm->cmsg_len >= CMSG_LEN(sizeof(int))) {
                int v;
                memcpy(&v, CMSG_DATA(cm), sizeof v);
                g = v;
            } else if (cm->cmsg_level == IPPROTO_IP && cm->cmsg_type == IP_TOS && cm->cmsg_len >= CMSG_LEN(1)) {
                e = CMSG_DATA(cm)[0] & 3; /* IP_RECVTOS: the TOS byte itself */
            } else if (cm->cmsg_level == IPPROTO_IPV6 && cm->cmsg_type == IPV6_TCLASS &&
                       cm->cmsg_len >= CMSG_LEN(sizeof(int))) {
                int v;
                memcpy(&v, CMSG_DATA(cm), sizeof v);
                e = (uint8_t)(v & 3);
            }
        }
        if (g < 1) g = 1;
        int64_t c = (total + g - 1) / g, last, lost = 0;
        if (c < 1) c = 1;
        last = total - (c - 1) * g;
        if (c > 1 && g != row)
            c = recut(f, row, total, g, &lost, &last);
        else if (c > cap - used) { /* more row-sized datagrams than rows left (UDP_SEGMENT sends up to 128
                                    * on newer kernels; GRO merges 64): the rest are lost, as in recut */
            lost = c - (cap - used);
            c = cap - used;
            last = g;
        } else if (c == 1 && total < HEADER_LEN)
            memset(f + total, 0, HEADER_LEN - total); /* no magic: rejected as invalid */
        res[0] += lost;
        if (c > 1) res[1] += c;
        if (f[KIND_AT] != KIND_DATA) res[4] = 1;
        int32_t p = peer_of((const uint8_t *)&from, names, npeer, stride, keyoff, keylen);
        for (int64_t i = 0; i < c; i++) {
            plen[used + i] = g;
            peer[used + i] = p;
        }
        memset(ecn + used, e, (size_t)c);
        plen[used + c - 1] = last;
        for (int64_t i = 0; i < c; i++)
            res[7] += !dblp_valid(f + i * row, plen[used + i]);
        used += c;
        res[2] += (c - 1) * g + last;
        if (g > res[3]) res[3] = g;
        if (last > res[3]) res[3] = last;
        res[6] += 1;
    }
    return used;
}

/* Send packets [0, n): header i at hdrs + 32 i, lens[i] payload bytes at pay + i *
 * pstride (or at addr[i] when addr is not NULL: the tensor's own rows), to peer[i]
 * (its socket address at names + peer * nstride, namelen bytes), with TOS byte
 * tos[i] (tos NULL: none set).  Messages are built in the caller's scratch: mm (cap
 * struct mmsghdr), iov (2 cap), cm (cap * 48 bytes).  Returns the
 * packets done (sent, or failed and skipped); res: [0] 0 all done, 1 the socket
 * buffer is full (wait, call again from there), 2 the kernel refused a segmented
 * message (call again without gso); [1] packets sent, [2] bytes (approx. on
 * errors, as udp.py), [3] packets sent inside multi-datagram messages, [4]
 * packets failed, [5] copies the kernel loops back (broadcast peers). */
int64_t dblp_udp_send(int fd, const uint8_t *hdrs, const uint8_t *pay, int64_t pstride, const uint64_t *addr,
                      const int64_t *lens,
                      const int64_t *peer, int64_t n, const uint8_t *tos, const uint8_t *names, int64_t namelen,
                      int64_t nstride, const uint8_t *v6peer, const uint8_t *bcast, int gso, int gro,
                      struct mmsghdr *mm, struct iovec *iov, uint8_t *cm, int64_t cap, int64_t *res) {
    int64_t sent = 0;
    res[0] = 0;
    while (sent < n) {
        /* group packets [sent, ...) into at most cap messages of at most cap packets */
        int64_t nm = 0, p = sent;
        while (p < n && nm < cap && p - sent < cap) {
            int64_t size = lens[p] + HEADER_LEN, k = 1;
            if (gso) {
                int64_t per = GSO_MAX_BYTES / size;
                if (per > GSO_MAX_SEGS) per = GSO_MAX_SEGS;
                while (p + k < n && k < per && p + k - sent < cap && peer[p + k] == peer[p] &&
                       lens[p + k] == lens[p] && (!tos || tos[p + k] == tos[p]))
                    k++;
            }
            struct msghdr *h = &mm[nm].msg_hdr;
            memset(h, 0, sizeof *h);
            h->msg_name = (void *)(names + peer[p] * nstride);
            h->msg_namelen = (socklen_t)namelen;
            h->msg_iov = &iov[2 * (p - sent)];
            h->msg_iovlen = 2 * k;
            for (int64_t i = 0; i < k; i++) {
                iov[2 * (p - sent + i)] = (struct iovec){(void *)(hdrs + (p + i) * HEADER_LEN), HEADER_LEN};
                const uint8_t *body = addr ? (const uint8_t *)(uintptr_t)addr[p + i] : pay + (p + i) * pstride;
                iov[2 * (p - sent + i) + 1] = (struct iovec){(void *)body, (size_t)lens[p + i]};
            }
            uint8_t *c = cm + nm * 48;
            size_t clen = 0;
            if (k > 1) { /* a run: one UDP_SEGMENT cmsg with the datagrams' size */
                struct cmsghdr *x = (struct cmsghdr *)c;
                x->cmsg_len = CMSG_LEN(sizeof(uint16_t));
                x->cmsg_level = SOL_UDP_;
                x->cmsg_type = UDP_SEGMENT_;
                uint16_t s = (uint16_t)size;
                memcpy(CMSG_DATA(x), &s, sizeof s);
                clen += CMSG_SPACE(sizeof(uint16_t));
            }
            if (tos) { /* IP_TOS to an IPv4 peer, IPV6_TCLASS to an IPv6 one */
                struct cmsghdr *x = (struct cmsghdr *)(c + clen);
                int v = tos[p];
                x->cmsg_len = CMSG_LEN(sizeof(int));
                x->cmsg_level = v6peer[peer[p]] ? IPPROTO_IPV6 : IPPROTO_IP;
                x->cmsg_type = v6peer[peer[p]] ? IPV6_TCLASS : IP_TOS;
                memcpy(CMSG_DATA(x), &v, sizeof v);
                clen += CMSG_SPACE(sizeof(int));
            }
            h->msg_control = clen ? c : NULL;
            h->msg_controllen = clen;
            mm[nm].msg_len = 0;
            nm++;
            p += k;
        }
        int64_t done = 0, pk = 0, errs = 0;
        while (done < nm) {
            int r = sendmmsg(fd, mm + done, (unsigned)(nm - done), MSG_DONTWAIT);
            if (r > 0) {
                for (int i = 0; i < r; i++) {
                    const struct msghdr *h = &mm[done + i].msg_hdr;
                    int64_t k = h->msg_iovlen / 2, q = peer[sent + pk];
                    if (k > 1) res[3] += k;
                    if (bcast[q]) res[5] += gro ? 1 : k;
                    pk += k;
                }
                done += r;
                continue;
            }
            int e = errno;
            if (e == EAGAIN || e == ENOBUFS || e == EINTR) {
                res[0] = 1;
                break;
            }
            int64_t k = mm[done].msg_hdr.msg_iovlen / 2;
            if (k > 1 && (e == EINVAL || e == EIO || e == EOPNOTSUPP)) {
                res[0] = 2;
                break;
            }
            /* this message failed (unreachable, refused...): count it, skip it */
            res[4] += k;
            errs += k;
            pk += k;
            done++;
        }
        int64_t bytes = 0;
        for (int64_t i = sent; i < sent + pk; i++) bytes += lens[i];
        res[1] += pk - errs;
        res[2] += bytes + (pk - errs) * HEADER_LEN;
        sent += pk;
        if (res[0]) break;
    }
    return sent;
}

/* Which source this library was built from (pydblp/native.py tells a stale copy by it). */
#ifndef DBLP_SOURCE_ID
#define DBLP_SOURCE_ID "unknown"
#endif
const char *dblp_source_id(void) { return DBLP_SOURCE_ID; }

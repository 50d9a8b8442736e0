#include "transfer/ucx_metadata.h"

#include <cstring>

#include "common/bytes.h"
#include "common/format.h"

namespace rd2h::transfer {

std::vector<std::byte> encode_ucx_metadata(const UcxMetadata& meta) {
  ByteWriter w;
  w.raw(kUcxMetadataMagic, sizeof(kUcxMetadataMagic));
  w.u32(kUcxMetadataVersion);
  w.str(meta.session_id);
  w.str(meta.hostname);
  w.str(meta.transport);
  w.str(meta.identity.boot_id);
  w.u64(meta.identity.pid_namespace);
  w.u32(static_cast<uint32_t>(meta.identity.pid));
  w.u64(meta.identity.start_time);
  w.bytes(meta.worker_address);
  w.u32(static_cast<uint32_t>(meta.regions.size()));
  for (const auto& r : meta.regions) {
    w.u64(r.base);
    w.u64(r.length);
    w.bytes(r.packed_rkey);
    w.u32(static_cast<uint32_t>(r.fd));
    w.u64(r.inode);
    w.u64(r.file_offset);
    w.u64(r.live_offset);
  }
  return w.take();
}

Expected<UcxMetadata> decode_ucx_metadata(std::span<const std::byte> bytes) {
  ByteReader r(bytes);
  auto magic = r.raw("magic", sizeof(kUcxMetadataMagic));
  if (!magic) return magic.status().with_context("UCX engine metadata");
  if (std::memcmp(magic->data(), kUcxMetadataMagic, sizeof(kUcxMetadataMagic)) != 0) {
    return invalid_metadata(
        "UCX engine metadata: bad magic (not metadata exported by rd2h's "
        "UCX engine)");
  }
  auto version = r.u32("version");
  if (!version) return version.status().with_context("UCX engine metadata");
  if (*version != kUcxMetadataVersion) {
    return invalid_metadata("UCX engine metadata: version " + std::to_string(*version) +
                            " is not supported (this engine reads version " +
                            std::to_string(kUcxMetadataVersion) + ")");
  }

  auto fail = [](const Status& s) { return s.with_context("UCX engine metadata"); };
  UcxMetadata m;
  {
    auto v = r.str("session_id", kMaxMetadataString);
    if (!v) return fail(v.status());
    m.session_id = std::move(*v);
  }
  {
    auto v = r.str("hostname", kMaxMetadataString);
    if (!v) return fail(v.status());
    m.hostname = std::move(*v);
  }
  {
    auto v = r.str("transport", kMaxMetadataString);
    if (!v) return fail(v.status());
    m.transport = std::move(*v);
  }
  {
    auto v = r.str("boot_id", kMaxMetadataString);
    if (!v) return fail(v.status());
    m.identity.boot_id = std::move(*v);
  }
  {
    auto v = r.u64("pid_namespace");
    if (!v) return fail(v.status());
    m.identity.pid_namespace = *v;
  }
  {
    auto v = r.u32("pid");
    if (!v) return fail(v.status());
    m.identity.pid = static_cast<int32_t>(*v);
  }
  {
    auto v = r.u64("start_time");
    if (!v) return fail(v.status());
    m.identity.start_time = *v;
  }
  {
    auto v = r.bytes("worker_address", kMaxWorkerAddress);
    if (!v) return fail(v.status());
    if (v->empty()) return invalid_metadata("UCX engine metadata: empty worker address");
    m.worker_address.assign(v->begin(), v->end());
  }
  if (m.session_id.empty()) return invalid_metadata("UCX engine metadata: empty session id");

  auto count = r.u32("region_count");
  if (!count) return fail(count.status());
  // Each region takes at least 48 bytes, so a count the bytes cannot hold is rejected before
  // anything is allocated for it.
  if (*count > kMaxRegions || *count > r.remaining() / 48) {
    return invalid_metadata("UCX engine metadata: region count " + std::to_string(*count) +
                            " does not fit in the " + std::to_string(r.remaining()) +
                            " bytes left (limit " + std::to_string(kMaxRegions) + ")");
  }
  m.regions.reserve(*count);
  for (uint32_t i = 0; i < *count; ++i) {
    ExportedRegion region;
    auto base = r.u64("region base");
    if (!base) return fail(base.status());
    auto len = r.u64("region length");
    if (!len) return fail(len.status());
    auto rkey = r.bytes("region rkey", kMaxPackedRkey);
    if (!rkey) return fail(rkey.status());
    auto fd = r.u32("region fd");
    if (!fd) return fail(fd.status());
    auto inode = r.u64("region inode");
    if (!inode) return fail(inode.status());
    auto file_offset = r.u64("region file offset");
    if (!file_offset) return fail(file_offset.status());
    auto live_offset = r.u64("region live offset");
    if (!live_offset) return fail(live_offset.status());
    region.base = *base;
    region.length = *len;
    region.packed_rkey.assign(rkey->begin(), rkey->end());
    region.fd = static_cast<int32_t>(*fd);
    region.inode = *inode;
    region.file_offset = *file_offset;
    region.live_offset = *live_offset;
    std::string where = "UCX engine metadata: region " + std::to_string(i) + " [" +
                        hex(region.base) + ", +" + std::to_string(region.length) + ")";
    if (region.length == 0) return invalid_metadata(where + " is empty");
    if (region.base + region.length < region.base) return invalid_metadata(where + " wraps");
    if (region.packed_rkey.empty()) return invalid_metadata(where + " has no rkey");
    if (region.fd < -1) return invalid_metadata(where + " names fd " + std::to_string(region.fd));
    if (region.fd >= 0 && region.file_offset + region.length < region.file_offset) {
      return invalid_metadata(where + " lies past the end of its file");
    }
    if (!m.regions.empty()) {
      const auto& prev = m.regions.back();
      if (region.base < prev.base + prev.length) {
        return invalid_metadata(where + " is unsorted or overlaps the previous region");
      }
    }
    m.regions.push_back(std::move(region));
  }
  if (!r.at_end()) {
    return invalid_metadata("UCX engine metadata: " + std::to_string(r.remaining()) +
                            " trailing bytes");
  }
  return m;
}

}  // namespace rd2h::transfer

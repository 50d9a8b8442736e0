#include "transfer/ucx_metadata.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <exception>
#include <limits>
#include <msgpack.hpp>
#include <string_view>

#include "common/format.h"
#include "common/msgpack_util.h"

namespace rd2h::transfer {
namespace {

using Object = msgpack::object;

// The bytes versions 1 and 2 began with: such a peer is named, not parsed as msgpack.
constexpr std::string_view kLegacyMagic = "RD2HUCXM";

// What msgpack may build before a field is looked at. Version 3 nests 3 deep (metadata,
// regions, region) with at most 7 fields a map; the limits leave room for a later version to
// nest and add fields, so its peer hears of the version rather than of a msgpack limit.
// msgpack allocates an array's items when it reads the header, so an array may declare no
// more items than the bytes could hold regions (each takes over 32 bytes); strings and bins
// are read in place, not copied. What a blob makes msgpack allocate is linear in its size.
constexpr size_t kUnpackDepth = 6;
constexpr size_t kUnpackMapPairs = 32;
constexpr size_t kMinRegionBytes = 32;

constexpr std::array<std::string_view, 7> kMetadataKeys = {
    "v", "session_id", "hostname", "transport", "identity", "worker_address", "regions"};
constexpr std::array<std::string_view, 4> kIdentityKeys = {"boot_id", "pid_namespace", "pid",
                                                           "start_time"};
constexpr std::array<std::string_view, 7> kRegionKeys = {"base",  "length",      "rkey",       "fd",
                                                         "inode", "file_offset", "live_offset"};

using msgpack_util::ByteSink;
using msgpack_util::pack_bin;
using msgpack_util::pack_str;
using msgpack_util::type_name;
using Packer = msgpack::packer<ByteSink>;

void pack_identity(Packer& pk, const HostIdentity& id) {
  pk.pack_map(kIdentityKeys.size());
  pack_str(pk, "boot_id");
  pack_str(pk, id.boot_id);
  pack_str(pk, "pid_namespace");
  pk.pack_uint64(id.pid_namespace);
  pack_str(pk, "pid");
  pk.pack_int32(id.pid);
  pack_str(pk, "start_time");
  pk.pack_uint64(id.start_time);
}

void pack_region(Packer& pk, const ExportedRegion& r) {
  pk.pack_map(kRegionKeys.size());
  pack_str(pk, "base");
  pk.pack_uint64(r.base);
  pack_str(pk, "length");
  pk.pack_uint64(r.length);
  pack_str(pk, "rkey");
  pack_bin(pk, r.packed_rkey);
  pack_str(pk, "fd");
  pk.pack_int32(r.fd);
  pack_str(pk, "inode");
  pk.pack_uint64(r.inode);
  pack_str(pk, "file_offset");
  pk.pack_uint64(r.file_offset);
  pack_str(pk, "live_offset");
  pk.pack_uint64(r.live_offset);
}

Status bad(const std::string& path, const std::string& what) {
  return invalid_metadata("UCX engine metadata: " + (path.empty() ? what : path + ": " + what));
}

std::string join(const std::string& path, std::string_view key) {
  return path.empty() ? std::string(key) : path + "." + std::string(key);
}

// A key from the peer, quoted and cut short, for an error message.
std::string quoted(std::string_view s) {
  std::string out = "\"";
  for (char c : s.substr(0, 64)) out += (c >= 0x20 && c < 0x7f) ? c : '?';
  return out + (s.size() > 64 ? "...\"" : "\"");
}

Expected<uint64_t> read_uint(const Object& o, const std::string& path) {
  if (o.type == msgpack::type::NEGATIVE_INTEGER) {
    return bad(path, std::to_string(o.via.i64) + " is negative");
  }
  if (o.type != msgpack::type::POSITIVE_INTEGER) {
    return bad(path, "expected an unsigned integer, got " + type_name(o));
  }
  return o.via.u64;
}

// An integer in [min, max]; max is not negative.
Expected<int64_t> read_int(const Object& o, const std::string& path, int64_t min, int64_t max) {
  if (o.type == msgpack::type::POSITIVE_INTEGER) {
    if (o.via.u64 > static_cast<uint64_t>(max)) {
      return bad(path, std::to_string(o.via.u64) + " exceeds the limit of " + std::to_string(max));
    }
    return static_cast<int64_t>(o.via.u64);
  }
  if (o.type == msgpack::type::NEGATIVE_INTEGER) {
    if (o.via.i64 < min) {
      return bad(path, std::to_string(o.via.i64) + " is below " + std::to_string(min));
    }
    return o.via.i64;
  }
  return bad(path, "expected an integer, got " + type_name(o));
}

Expected<std::string> read_str(const Object& o, const std::string& path) {
  if (o.type != msgpack::type::STR) return bad(path, "expected a str, got " + type_name(o));
  if (o.via.str.size > kMaxMetadataString) {
    return bad(path, std::to_string(o.via.str.size) + " bytes exceed the limit of " +
                         std::to_string(kMaxMetadataString));
  }
  return std::string(o.via.str.ptr, o.via.str.size);
}

// A bin of 1 to `max_bytes` bytes.
Expected<std::vector<std::byte>> read_bin(const Object& o, const std::string& path,
                                          size_t max_bytes) {
  if (o.type != msgpack::type::BIN) return bad(path, "expected bin, got " + type_name(o));
  if (o.via.bin.size == 0) return bad(path, "empty");
  if (o.via.bin.size > max_bytes) {
    return bad(path, std::to_string(o.via.bin.size) + " bytes exceed the limit of " +
                         std::to_string(max_bytes));
  }
  const auto* p = reinterpret_cast<const std::byte*>(o.via.bin.ptr);
  return std::vector<std::byte>(p, p + o.via.bin.size);
}

// The values of a map that holds each of `keys` exactly once, in any order, and nothing else.
template <size_t N>
struct Fields {
  const std::array<std::string_view, N>& keys;
  std::array<const Object*, N> values{};

  const Object& operator[](std::string_view key) const {
    return *values[static_cast<size_t>(std::find(keys.begin(), keys.end(), key) - keys.begin())];
  }
};

template <size_t N>
Expected<Fields<N>> read_map(const Object& o, const std::string& path,
                             const std::array<std::string_view, N>& keys) {
  if (o.type != msgpack::type::MAP) return bad(path, "expected a map, got " + type_name(o));
  Fields<N> fields{keys};
  for (uint32_t i = 0; i < o.via.map.size; ++i) {
    const msgpack::object_kv& kv = o.via.map.ptr[i];
    if (kv.key.type != msgpack::type::STR) {
      return bad(path, "a field is named by a msgpack " + type_name(kv.key) + ", not a str");
    }
    const std::string_view key(kv.key.via.str.ptr, kv.key.via.str.size);
    const auto it = std::find(keys.begin(), keys.end(), key);
    if (it == keys.end()) return bad(path, "unknown field " + quoted(key));
    const Object*& slot = fields.values[static_cast<size_t>(it - keys.begin())];
    if (slot != nullptr) return bad(join(path, key), "given twice");
    slot = &kv.val;
  }
  for (size_t k = 0; k < N; ++k) {
    if (fields.values[k] == nullptr) return bad(join(path, keys[k]), "missing");
  }
  return fields;
}

// Strings and bins stay in the caller's bytes, which outlive the tree.
bool read_in_place(msgpack::type::object_type, size_t, void*) {
  return true;
}

// Parses a blob within the limits above: one msgpack map and nothing after it.
Expected<msgpack::object_handle> unpack_bounded(std::span<const std::byte> bytes) {
  if (bytes.empty()) return bad("", "empty");
  if (bytes.size() > kMaxUcxMetadataBytes) {
    return bad("", std::to_string(bytes.size()) + " bytes exceed the limit of " +
                       std::to_string(kMaxUcxMetadataBytes));
  }
  const char* data = reinterpret_cast<const char*>(bytes.data());
  if (bytes.size() >= kLegacyMagic.size() &&
      std::memcmp(data, kLegacyMagic.data(), kLegacyMagic.size()) == 0) {
    return bad("",
               "the little-endian format of version 2 or earlier (led by \"RD2HUCXM\"), "
               "exported by an older rd2h; this engine reads version " +
                   std::to_string(kUcxMetadataVersion));
  }
  const size_t items = std::min(kMaxRegions, bytes.size() / kMinRegionBytes);
  const msgpack::unpack_limit limit(items, kUnpackMapPairs, kMaxUcxMetadataBytes,
                                    kMaxUcxMetadataBytes, 0, kUnpackDepth);
  size_t offset = 0;
  msgpack::object_handle handle;
  try {
    handle = msgpack::unpack(data, bytes.size(), offset, read_in_place, nullptr, limit);
  } catch (const msgpack::insufficient_bytes&) {
    return bad("", "truncated");
  } catch (const msgpack::array_size_overflow&) {
    return bad("", "an array declares more than " + std::to_string(items) +
                       " items, the most regions " + std::to_string(bytes.size()) +
                       " bytes can hold (limit " + std::to_string(kMaxRegions) + ")");
  } catch (const msgpack::map_size_overflow&) {
    return bad("", "a map declares more than " + std::to_string(kUnpackMapPairs) + " fields");
  } catch (const msgpack::depth_size_overflow&) {
    return bad("", "nested deeper than " + std::to_string(kUnpackDepth));
  } catch (const std::exception& e) {
    return bad("", std::string("not valid msgpack (") + e.what() + ")");
  }
  if (handle.get().type != msgpack::type::MAP) {
    return bad("", "a msgpack " + type_name(handle.get()) +
                       ", not a map (not metadata exported by rd2h's UCX engine)");
  }
  if (offset != bytes.size()) {
    return bad("", std::to_string(bytes.size() - offset) + " trailing bytes");
  }
  return handle;
}

// The version first, so a peer of another version is told so, whatever else it sent.
Status check_version(const Object& root) {
  for (uint32_t i = 0; i < root.via.map.size; ++i) {
    const msgpack::object_kv& kv = root.via.map.ptr[i];
    if (kv.key.type != msgpack::type::STR ||
        std::string_view(kv.key.via.str.ptr, kv.key.via.str.size) != "v") {
      continue;
    }
    RD2H_TRY(version, read_uint(kv.val, "v"));
    if (version != kUcxMetadataVersion) {
      return bad("", "version " + std::to_string(version) +
                         " is not supported (this engine reads version " +
                         std::to_string(kUcxMetadataVersion) + ")");
    }
    return Status::ok();
  }
  return bad("", "no version field \"v\" (not metadata exported by rd2h's UCX engine)");
}

Expected<HostIdentity> read_identity(const Object& o) {
  RD2H_TRY(f, read_map(o, "identity", kIdentityKeys));
  HostIdentity id;
  RD2H_TRY(boot_id, read_str(f["boot_id"], "identity.boot_id"));
  RD2H_TRY(pid_namespace, read_uint(f["pid_namespace"], "identity.pid_namespace"));
  RD2H_TRY(pid, read_int(f["pid"], "identity.pid", 0, std::numeric_limits<int32_t>::max()));
  RD2H_TRY(start_time, read_uint(f["start_time"], "identity.start_time"));
  id.boot_id = std::move(boot_id);
  id.pid_namespace = pid_namespace;
  id.pid = static_cast<int32_t>(pid);
  id.start_time = start_time;
  return id;
}

Expected<ExportedRegion> read_region(const Object& o, const std::string& path) {
  RD2H_TRY(f, read_map(o, path, kRegionKeys));
  ExportedRegion r;
  RD2H_TRY(base, read_uint(f["base"], path + ".base"));
  RD2H_TRY(length, read_uint(f["length"], path + ".length"));
  RD2H_TRY(rkey, read_bin(f["rkey"], path + ".rkey", kMaxPackedRkey));
  RD2H_TRY(fd, read_int(f["fd"], path + ".fd", -1, std::numeric_limits<int32_t>::max()));
  RD2H_TRY(inode, read_uint(f["inode"], path + ".inode"));
  RD2H_TRY(file_offset, read_uint(f["file_offset"], path + ".file_offset"));
  RD2H_TRY(live_offset, read_uint(f["live_offset"], path + ".live_offset"));
  r.base = base;
  r.length = length;
  r.packed_rkey = std::move(rkey);
  r.fd = static_cast<int32_t>(fd);
  r.inode = inode;
  r.file_offset = file_offset;
  r.live_offset = live_offset;
  return r;
}

// What a connect() relies on of a region's place: it spans bytes, lies within the address
// space and its file, and comes after the region before it.
Status check_region_place(const ExportedRegion& r, const ExportedRegion* prev,
                          const std::string& path) {
  const std::string where = "UCX engine metadata: " + path + " " + range_text(r.base, r.length);
  if (r.length == 0) return invalid_metadata(where + " is empty");
  if (r.base + r.length < r.base) return invalid_metadata(where + " wraps");
  if (r.fd >= 0 && r.file_offset + r.length < r.file_offset) {
    return invalid_metadata(where + " lies past the end of its file");
  }
  if (prev != nullptr && r.base < prev->base + prev->length) {
    return invalid_metadata(where + " is unsorted or overlaps the previous region");
  }
  return Status::ok();
}

Expected<std::vector<ExportedRegion>> read_regions(const Object& o) {
  if (o.type != msgpack::type::ARRAY) {
    return bad("regions", "expected an array, got " + type_name(o));
  }
  // At most kMaxRegions: msgpack refused a longer array while parsing.
  std::vector<ExportedRegion> regions;
  regions.reserve(o.via.array.size);
  for (uint32_t i = 0; i < o.via.array.size; ++i) {
    const std::string path = "regions[" + std::to_string(i) + "]";
    RD2H_TRY(region, read_region(o.via.array.ptr[i], path));
    RD2H_RETURN_IF_ERROR(
        check_region_place(region, regions.empty() ? nullptr : &regions.back(), path));
    regions.push_back(std::move(region));
  }
  return regions;
}

}  // namespace

std::vector<std::byte> encode_ucx_metadata(const UcxMetadata& meta) {
  std::vector<std::byte> out;
  ByteSink sink{out};
  Packer pk(sink);
  pk.pack_map(kMetadataKeys.size());
  pack_str(pk, "v");
  pk.pack_uint32(kUcxMetadataVersion);
  pack_str(pk, "session_id");
  pack_str(pk, meta.session_id);
  pack_str(pk, "hostname");
  pack_str(pk, meta.hostname);
  pack_str(pk, "transport");
  pack_str(pk, meta.transport);
  pack_str(pk, "identity");
  pack_identity(pk, meta.identity);
  pack_str(pk, "worker_address");
  pack_bin(pk, meta.worker_address);
  pack_str(pk, "regions");
  pk.pack_array(static_cast<uint32_t>(meta.regions.size()));
  for (const auto& r : meta.regions) pack_region(pk, r);
  return out;
}

Expected<UcxMetadata> decode_ucx_metadata(std::span<const std::byte> bytes) {
  RD2H_TRY(handle, unpack_bounded(bytes));
  const Object& root = handle.get();
  RD2H_RETURN_IF_ERROR(check_version(root));
  RD2H_TRY(f, read_map(root, "", kMetadataKeys));
  RD2H_TRY(session_id, read_str(f["session_id"], "session_id"));
  if (session_id.empty()) return bad("session_id", "empty");
  RD2H_TRY(hostname, read_str(f["hostname"], "hostname"));
  RD2H_TRY(transport, read_str(f["transport"], "transport"));
  RD2H_TRY(identity, read_identity(f["identity"]));
  RD2H_TRY(worker_address, read_bin(f["worker_address"], "worker_address", kMaxWorkerAddress));
  RD2H_TRY(regions, read_regions(f["regions"]));
  UcxMetadata m;
  m.session_id = std::move(session_id);
  m.hostname = std::move(hostname);
  m.transport = std::move(transport);
  m.identity = std::move(identity);
  m.worker_address = std::move(worker_address);
  m.regions = std::move(regions);
  return m;
}

}  // namespace rd2h::transfer
